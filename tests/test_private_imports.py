"""scripts/check_private_imports.py: no module of the package, benchmarks, scripts or tests
uses a private name of another module, and the checker finds each kind of private use it claims to."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "check_private_imports.py"


def _run(*trees: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *trees], capture_output=True, text=True, cwd=ROOT)


def test_no_private_names_across_modules_anywhere():
    res = _run()
    assert res.returncode == 0, res.stdout
    assert res.stdout.strip() == "0 private use(s) across modules in src, benchmarks, scripts, tests"


def test_checker_reports_each_kind_of_private_use():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import check_private_imports as check
    finally:
        sys.path.pop(0)
    probe = ROOT / "scripts" / "_probe_private_uses.py"
    private_module = ROOT / "src" / "nmprune" / "_probe_private_module.py"
    private_module.write_text("X = 1\n")
    probe.write_text(
        "from __future__ import annotations\n"
        "import nmprune.prox.newton as newton\n"
        "from nmprune import _probe_private_module\n"  # a private module from outside nmprune
        "from nmprune.prox.newton import _unknown, damped_newton\n"
        "from nmprune.prox import newton as nt\n"
        "x = newton._hidden + newton.__doc__.__len__() + len(nt.damped_newton.__name__)\n"
        "setattr(nt, '_flag', 1)\n"
    )
    try:
        lines = check.findings(probe, check.module_names())
    finally:
        probe.unlink()
        private_module.unlink()
    text = "\n".join(lines)
    assert len(lines) == 4, text
    assert ":3: imports the private module nmprune._probe_private_module" in text
    assert ":4: imports _unknown from nmprune.prox.newton" in text
    assert ":6: uses nmprune.prox.newton._hidden" in text
    assert ":7: uses nmprune.prox.newton._flag" in text
    # inside the package a private module is fine; a private name of another module is not
    inside = check.findings(ROOT / "src" / "nmprune" / "prox" / "__init__.py", check.module_names())
    assert inside == []
