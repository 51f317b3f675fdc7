"""The configuration matrix on the CPU: the build refuses a configuration some main MSA kernel cannot implement (one
paragraph with the measured limit), `list` names what each family implements, the default build carries D 64 and
128 with blocks of 128 in bf16 and f16, and the runtime's table of unreachable points agrees with the catalogue."""

import pytest

from build_tools import coverage
from kernels_src import matrix


def test_default_build_serves_d64_and_d128_at_blocks_of_128_in_both_dtypes():
    for arch in ("sm90a", "sm100a"):
        got = coverage.served(arch, matrix.DEFAULT_HEAD_DIMS, matrix.DEFAULT_BLOCK_SIZES, ("bf16", "f16"))
        assert sorted(got) == sorted((d, 128, dt) for d in (64, 128) for dt in ("bf16", "f16")), (arch, got)


@pytest.mark.parametrize("d, bs", [(d, bs) for d in matrix.HEAD_DIMS for bs in matrix.BLOCK_SIZES])
def test_every_main_family_builds_every_point_of_the_matrix(d, bs):
    """Every point on both archs: sm90a on wgmma, sm100a on mma.sync (at D 256 with dQ and O formed in column
    pieces, kernels_src/sparse_bwd/kernel.py dq_pieces, sparse_fwd/kernel.py o_pieces)."""
    for arch in ("sm90a", "sm100a"):
        for name in coverage.MAIN_FAMILIES:
            ok, why = coverage.buildable(name, arch, d, bs, "bf16")
            assert ok, (arch, name, d, bs, why)


def test_unreachable_head_dims_agree_with_the_catalogue():
    from flash_msa_rt.ops.kernels import UNREACHABLE_HEAD_DIMS

    for d in matrix.HEAD_DIMS:
        reachable = all(coverage.buildable(n, "sm90a", d, bs, "bf16")[0] for n in coverage.MAIN_FAMILIES
                        for bs in matrix.BLOCK_SIZES)
        assert reachable == (d not in UNREACHABLE_HEAD_DIMS), d
    # D 256 reaches the kernels on 64-key blocks with one gather stage; its tiles at blocks of 128 would not fit
    from kernels_src import sparse_bwd

    ok, why = sparse_bwd.can_implement(sparse_bwd.MainConfig(head_dim=256, block_size=128, tile_n=128, stages=1,
                                                             mma="wgmma"), "sm90a")
    assert not ok and "shared memory" in why
    assert coverage.buildable("sparse_bwd", "sm90a", 256, 128, "bf16")[0]


@pytest.mark.parametrize("args, missing", [(["--block-size", "32"], "block_size 32 not supported"),
                                           (["--head-dim", "96"], "head_dim 96 not supported")])
def test_build_refuses_a_configuration_the_op_cannot_run_on(args, missing, capsys, tmp_path):
    from build_tools.__main__ import main

    assert main(["build", "--arch", "sm90a", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert "pure-PyTorch reference" in err and missing in err and "D 64 / blocks of 64" in err
    assert len(err.splitlines()) <= 8, err
    assert not any(tmp_path.iterdir())


def test_list_names_what_each_family_implements(capsys, tmp_path):
    from build_tools.__main__ import main

    assert main(["list", "--arch", "sm90a", "--out", str(tmp_path), "--head-dim", "64", "--block-size", "64"]) == 0
    out = capsys.readouterr().out
    assert "sparse_fwd" in out and "head dims 64,128,256" in out and "block sizes 64,128" in out
    assert "sparse_fwd_bf16_d64_b64_g4" in out


def test_runtime_message_names_the_build_command_or_the_limit():
    from flash_msa_rt.ops.kernels import _how_to_get

    cmd = _how_to_get("sm90a", "bf16", 64, 64, 64)
    assert "python -m build_tools build --arch sm90a --dtype bf16 --head-dim 64 --block-size 64" in cmd
    assert "--head-dim 256 --block-size 128" in _how_to_get("sm90a", "bf16", 256, 128, 128)
    assert "--arch sm100a --dtype bf16 --head-dim 256 --block-size 128" in _how_to_get("sm100a", "bf16", 256, 128, 128)
    assert "Dp 128 > D 64" in _how_to_get("sm90a", "bf16", 64, 128, 128)


def test_into_installed_names_the_installed_runtime_or_says_it_is_missing(monkeypatch, capsys):
    """--into-installed builds where a pip-installed runtime keeps its own cubins; without one it says what to do."""
    import importlib.metadata as md

    from build_tools.__main__ import main

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.setattr(md, "distribution", missing)
    assert main(["list", "--arch", "sm90a", "--into-installed"]) == 2
    assert "FLASH_MSA_ARTIFACT_DIR" in capsys.readouterr().err
