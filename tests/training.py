"""A small attention layer trained for a few SGD steps on CUDA, once on the kernels and once on the reference
backend (the seed-style training tests of the sparse and warmup ops)."""

import torch


def assert_training_matches_reference(attention, steps=10, S=700, tol=1e-2):
    """attention(q_proxy, k_proxy, q, k, v) -> (out, kl_loss), "bshd" layout. Trains the q/k/v/proxy projections
    of one layer on the same data with the kernel backend, then with the reference backend alone; every parameter
    must agree within tol of its scale."""
    from flash_msa_rt.ops import dispatch, kernels

    B, dm, H, Hk, Hp, D = 1, 256, 4, 1, 1, 128

    def make():
        torch.manual_seed(1)
        return torch.nn.ModuleDict({n: torch.nn.Linear(dm, h * D, bias=False) for n, h in
                                    (("q", H), ("k", Hk), ("v", Hk), ("qp", Hp), ("kp", Hp))}).cuda().bfloat16()

    torch.manual_seed(0)
    x = torch.randn(steps, B, S, dm, device="cuda").bfloat16()

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for step in range(steps):
            def heads(n, h):
                return model[n](x[step]).view(B, S, h, D)
            out, kl = attention(heads("qp", Hp), heads("kp", Hp), heads("q", H), heads("k", Hk), heads("v", Hk))
            loss = out.float().pow(2).mean() + 0.1 * kl
            opt.zero_grad()
            loss.backward()
            opt.step()
        return [p.detach().float() for p in model.parameters()]

    with_kernels = train(make())
    dispatch.unregister_backend(kernels.KERNELS.name)
    try:
        with_reference = train(make())
    finally:
        dispatch.register_backend(kernels.KERNELS)
    for a, b in zip(with_kernels, with_reference):
        assert (a - b).abs().max().item() <= tol * b.abs().max().item()
