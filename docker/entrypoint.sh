#!/bin/sh
# Container entrypoint: `pagedllm serve` with flags from PAGEDLLM_* env vars, followed by the
# container's arguments (later flags win, so `docker run IMAGE --max-num-seqs 64` overrides).
# Unset or empty variables add no flag (the server's default applies), except the host and
# port, which default to 0.0.0.0 (reachable from outside the container) and 8000.
# PAGEDLLM_API_KEY is read by the server itself, so the key never shows in the process list.
set -eu

# A model given after the image name (`docker run IMAGE /models/x.gguf`: a first argument that is
# not a flag) overrides PAGEDLLM_MODEL too; the CLI refuses a model given twice.
model_arg=""
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
    model_arg="$1"
fi

# POSIX sh has no arrays: the flags are prepended to "$@" itself, last flag first, so they
# come out in the order host, port, model, dtype, max-num-seqs, ... before the extra args.
if [ -n "${PAGEDLLM_KV_CACHE_SPACE:-}" ]; then
    set -- --kv-cache-space "$PAGEDLLM_KV_CACHE_SPACE" "$@"
fi
if [ -n "${PAGEDLLM_MAX_MODEL_LEN:-}" ]; then
    set -- --max-model-len "$PAGEDLLM_MAX_MODEL_LEN" "$@"
fi
if [ -n "${PAGEDLLM_MAX_NUM_BATCHED_TOKENS:-}" ]; then
    set -- --max-num-batched-tokens "$PAGEDLLM_MAX_NUM_BATCHED_TOKENS" "$@"
fi
if [ -n "${PAGEDLLM_MAX_NUM_SEQS:-}" ]; then
    set -- --max-num-seqs "$PAGEDLLM_MAX_NUM_SEQS" "$@"
fi
if [ -n "${PAGEDLLM_DTYPE:-}" ]; then
    set -- --dtype "$PAGEDLLM_DTYPE" "$@"
fi
if [ -n "${PAGEDLLM_MODEL:-}" ] && [ -z "$model_arg" ]; then
    set -- --model "$PAGEDLLM_MODEL" "$@"
fi
set -- --host "${PAGEDLLM_HOST:-0.0.0.0}" --port "${PAGEDLLM_PORT:-8000}" "$@"

# exec: the server replaces this shell (PID 1), so `docker stop`'s SIGTERM reaches it.
exec pagedllm serve "$@"
