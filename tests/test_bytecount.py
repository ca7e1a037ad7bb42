"""minite.bytecount: the traffic and memory counters the lessons rely on."""
import torch

from minite.bytecount import CountBytes, PeakBytes, nbytes, saved_bytes


def test_count_bytes_logs_reads_and_writes_and_skips_views():
    x = torch.empty(64, 100, device="meta")  # 25,600 bytes
    with CountBytes() as cb:
        y = x.exp()            # read x, write y
        z = (y + x).t()        # add: read 2, write 1; t() is a view: not logged
    assert [op for op, _, _ in cb.ops] == ["exp", "add"]
    assert cb.ops[0][1:] == (25_600, 25_600) and cb.ops[1][1:] == (51_200, 25_600)
    assert cb.total() == 128_000 and z.shape == (100, 64)
    assert nbytes([x, (y, 3)]) == 51_200


def test_peak_bytes_frees_dead_tensors():
    x = torch.empty(1000, device="meta")  # 4,000 bytes, created outside: not counted
    with PeakBytes() as pb:
        a = x * 2
        b = a * 2
        del a
        c = b * 2
    assert pb.peak == 8_000 and c.numel() == 1000


def test_saved_bytes_counts_what_autograd_keeps():
    x = torch.randn(10, 20, requires_grad=True)
    assert saved_bytes(lambda t: t.exp(), x) == 800          # exp saves its output
    assert saved_bytes(lambda t: t * 2.0, x) == 0            # scaling by a constant saves nothing
    assert saved_bytes(lambda t: t.sigmoid() * t, x) == 1600  # sigmoid's output and t
