"""The runtime must never import cutlass (nor the build-time packages), at import or at launch."""

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FORBIDDEN = ("cutlass", "kernels_src", "build_tools")

LAUNCH_SCRIPT = r"""
import sys, torch
sys.path.insert(0, {tests!r})
import flash_msa_rt
from fakes import FakeCudaTensor, FakeDriver
from test_runtime_cpu import toy_entry, write_artifacts, toy_args, OP, CONFIG
import pathlib, tempfile, os
root = pathlib.Path(tempfile.mkdtemp())
entry = toy_entry(); write_artifacts(root, [entry])
os.environ["FLASH_MSA_ARTIFACT_DIR"] = str(root)
class MP:
    def setattr(self, obj, name, value): setattr(obj, name, value)
fake = FakeDriver([p.size for p in entry.params]); fake.install(MP())
from flash_msa_rt import loader
loader.get_kernel(OP, CONFIG, torch.device("cuda", 0))(**toy_args())
assert len(fake.launches) == 1
bad = sorted(m for m in sys.modules if m.split(".")[0] in {forbidden!r})
print("FORBIDDEN:" + ",".join(bad))
"""


def test_runtime_sources_never_import_build_time_packages():
    for path in (REPO / "flash_msa_rt").rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in FORBIDDEN, f"{path.relative_to(REPO)} imports {n}"


def test_import_and_launch_load_no_cutlass():
    code = LAUNCH_SCRIPT.format(tests=str(REPO / "tests"), forbidden=set(FORBIDDEN))
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "FORBIDDEN:\n" in r.stdout or r.stdout.strip().endswith("FORBIDDEN:"), r.stdout
