"""What the CPU paths that run on MKL (F.linear on a dense weight, torch.bmm) must respect to stay
batch-invariant: MKL computes fp32 rows in micro-tiles of MKL_ROW_MULTIPLE, and the rows of a
last, partial tile get other bits, so callers pad M up to a multiple of it."""
MKL_ROW_MULTIPLE = 4
