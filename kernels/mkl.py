"""What the CPU paths that run on MKL (F.linear on a dense weight, torch.bmm) must respect to stay
batch-invariant: MKL computes fp32 rows in micro-tiles of MKL_ROW_MULTIPLE, and the rows of a
last, partial tile get other bits, so callers pad M up to a multiple of it. On an Intel Xeon
MKL's sgemm also changes kernels with M (kernels/linear.py), so the dense F.linear path calls it
on exactly MKL_ROW_MULTIPLE rows at a time. The attention reference's per-head products (K = head_dim)
keep a row's bits at every padded M on both vendors (tests/kernels/test_attention_reference.py)."""
MKL_ROW_MULTIPLE = 4
