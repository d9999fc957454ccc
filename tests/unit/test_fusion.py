import torch

from hpcadapt.comm.fusion import Bucket, plan_buckets


def test_plan_respects_size_and_dtype():
    ts = [torch.zeros(10), torch.zeros(10), torch.zeros(300), torch.zeros(5, dtype=torch.float64),
          torch.zeros(5, dtype=torch.float64)]
    groups = plan_buckets(ts, bucket_bytes=100)
    assert groups == [[0, 1], [2], [3, 4]]
    assert sorted(i for g in groups for i in g) == list(range(len(ts)))


def test_pack_unpack_round_trip_with_extra_slots():
    ts = [torch.randn(3, 4), torch.randn(7), torch.randn(2, 2, 2)]
    b = Bucket.for_tensors(ts, extra=3)
    b.pack(ts)
    assert b.flat.numel() == 12 + 7 + 8 + 3
    assert torch.equal(b.payload[:12], ts[0].reshape(-1))
    outs = [torch.empty_like(t) for t in ts]
    b.flat.mul_(2)
    b.unpack(outs)
    for t, o in zip(ts, outs):
        assert torch.allclose(o, 2 * t)
