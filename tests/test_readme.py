"""The README's Python samples run as written: a user pastes them first.

Each self-contained sample (it imports what it uses and needs no files of the user's) runs in a
fresh interpreter; a sample that raises fails here. The structured-outputs sample validates its
own output with pydantic, so a schema the default model cannot fill fails too.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parent.parent / "README.md"


def python_samples() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(), flags=re.S | re.M)


def self_contained(sample: str) -> bool:
    return sample.lstrip().startswith(("from ", "import ")) and "/adapters/" not in sample


SAMPLES = [s for s in python_samples() if self_contained(s)]


def test_the_readme_has_the_samples_this_test_runs():
    assert len(SAMPLES) >= 3, "the README's offline, structured-outputs and AsyncLLM samples"
    assert any("StructuredOutputsParams" in s for s in SAMPLES)
    assert any("AsyncLLM" in s for s in SAMPLES)


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.splitlines()[-1][:40] for s in SAMPLES])
def test_a_readme_sample_runs(sample, tmp_path):
    env_setup = "import os\nos.environ.setdefault('PAGEDLLM_LOGGING_LEVEL', 'WARNING')\n"
    script = tmp_path / "sample.py"
    script.write_text(env_setup + sample)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the sample printed nothing"
