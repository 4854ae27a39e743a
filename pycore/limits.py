"""The size limits the library holds its inputs and its work to (docs/cli.md, docs/design.md §5).

Each check reads its limit from this module when it runs, so a program may change one for its own
process, ``pycore.limits.MAX_WORK_BYTES = 16 << 30`` on a machine with the memory for it, and a
test may lower one to show that the check comes before the allocation. An input past a limit is
refused, naming the limit, before the memory it would need is asked for.
"""

# Largest dense float64 array a call sets out to allocate: a 35k × 35k U (10 GB) is refused before
# LAPACK starts, where it could not be interrupted.
MAX_DENSE_BYTES = 4 << 30  # 4 GiB

# Largest float64 working set one method or evaluation sets out to use on a task of D inputs:
# its D×D arrays (θ, K_P, K_H, preconditioners, Adam's moments, SVD factors) and its N×D row
# blocks (features Xθ, left singular vectors), counted per entry point from tracemalloc peaks
# (the table WORK of pycore/_immunization.py). Each array may pass MAX_DENSE_BYTES while the set
# does not: a 2 × 30,000 task is 480 KB, and Algorithm 1 on it needs ~141 GiB.
MAX_WORK_BYTES = 4 << 30  # 4 GiB

# Upper limit on an input file read whole: the project's are ≤ 50 MB; /dev/zero or a runaway log
# becomes an error instead of an unbounded read.
MAX_DATA_FILE_BYTES = 1 << 30  # 1 GiB

# Decompressed bytes a θ archive is read to unless told more: a 3.9 MB file may declare gigabytes
# of deflated zeros; a House Prices archive of every method and seed is ~5 MB.
MAX_ARCHIVE_BYTES = 1 << 30

# θ is D×D: at 4,096 inputs one D×D array is 134 MB and the largest method holds ~21 of them (2.8
# GB, inside MAX_WORK_BYTES); at 10,000 a 5 MB file asked for more than 6 GB and pandas alone took
# a minute. The paper's table has 79.
MAX_COLUMNS = 4096
MAX_HEADER_BYTES = 1 << 20

# A checkpoint is read whole into memory: ViT-g in float32 is ~4 GB.
MAX_CHECKPOINT_BYTES = 8 << 30

MAX_IMAGE_PIXELS = 40_000_000  # 160 MB as float32 RGB before resizing
MAX_ASPECT = 20  # longer side / shorter side: a resize of the short side stays bounded
# A task's classes are max(label) + 1, and a classifier is sized by them: one label of 5,000,000
# among 16 samples asked for a 20.5 GB head.  timm's num_classes bound (create_model) is the same.
MAX_CLASSES = 100_000

__all__ = [
    "MAX_DENSE_BYTES",
    "MAX_WORK_BYTES",
    "MAX_DATA_FILE_BYTES",
    "MAX_ARCHIVE_BYTES",
    "MAX_COLUMNS",
    "MAX_HEADER_BYTES",
    "MAX_CHECKPOINT_BYTES",
    "MAX_IMAGE_PIXELS",
    "MAX_ASPECT",
    "MAX_CLASSES",
]
