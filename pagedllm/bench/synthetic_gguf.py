"""Write a random-weight GGUF of a real model's shape, for memory and speed checks of big models.

    python -m pagedllm.bench.synthetic_gguf OUT.gguf [--shape llama3-8b] [--qtype Q4_0] [--layers N]

The weights are random blocks of the chosen type (random quants, small random fp16 scales),
streamed to the file one tensor at a time, so writing a 4.5 GB file needs little memory. The
vocabulary is a placeholder SentencePiece-style list (byte tokens plus fillers) that both
llama.cpp and transformers accept; the model's text is noise, its speed and memory are real.
Nothing is downloaded, nothing is committed: generate it where it is measured.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from pagedllm.kernels.gguf_ops import GGUF_TYPES


@dataclass
class Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    rope_theta: float
    context: int


SHAPES = {
    # Meta-Llama-3-8B's config.json
    "llama3-8b": Shape(128256, 4096, 14336, 32, 32, 8, 500000.0, 8192),
    "llama2-7b": Shape(32000, 4096, 11008, 32, 32, 32, 10000.0, 4096),
}
# Byte offsets of the fp16 scale fields in one block (gguf-py's layouts).
_SCALES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
           "Q5_K": (0, 2), "Q6_K": (208,)}  # fmt: skip


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator, scale: float) -> np.ndarray:
    """[rows, row_bytes] uint8 of random blocks with finite scales of about ``scale``."""
    _, block, size = GGUF_TYPES[qtype]
    n = rows * cols // block
    data = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in _SCALES[qtype]:
        data[:, off : off + 2] = (rng.random((n, 1), dtype=np.float32) * scale).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def write(out: str, shape: Shape, qtype: str, seed: int = 0) -> None:
    import gguf

    if qtype not in _SCALES:
        raise ValueError(f"qtype must be one of {', '.join(_SCALES)}")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(out, "llama")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.hidden)
    w.add_feed_forward_length(shape.intermediate)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_file_type({"Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}.get(qtype, 15))
    # A placeholder SentencePiece vocabulary: <unk> <s> </s>, the 256 byte tokens, fillers.
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(shape.vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (shape.vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(shape.vocab - 259)])
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    h, i, kv = shape.hidden, shape.intermediate, shape.kv_heads * (shape.hidden // shape.heads)
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    plan: list[tuple[str, tuple[int, int] | int]] = [("token_embd.weight", (shape.vocab, h))]
    for layer in range(shape.layers):
        p = f"blk.{layer}."
        plan += [(p + "attn_norm.weight", h), (p + "ffn_norm.weight", h)]
        plan += [(p + "attn_q.weight", (h, h)), (p + "attn_k.weight", (kv, h)), (p + "attn_v.weight", (kv, h))]
        plan += [(p + "attn_output.weight", (h, h)), (p + "ffn_gate.weight", (i, h)), (p + "ffn_up.weight", (i, h))]
        plan += [(p + "ffn_down.weight", (h, i))]
    plan += [("output_norm.weight", h), ("output.weight", (shape.vocab, h))]
    _, block, size = GGUF_TYPES[qtype]
    for name, dims in plan:
        if isinstance(dims, int):
            w.add_tensor_info(name, (dims,), np.dtype(np.float32), dims * 4)
        else:
            rows, cols = dims
            w.add_tensor_info(name, (rows, cols // block * size), np.dtype(np.uint8), rows * cols // block * size, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0, written = time.perf_counter(), 0
    for name, dims in plan:
        if isinstance(dims, int):
            w.write_tensor_data(np.ones(dims, dtype=np.float32))
            continue
        rows, cols = dims
        # Scales ~ 1/sqrt(fan-in) over the quants' spread keep activations of order one.
        scale = 2.0 / (8 * np.sqrt(cols))
        for start in range(0, rows, 8192):  # in slices: never the whole tensor in memory
            n = min(8192, rows - start)
            chunk = random_blocks(qtype, n, cols, rng, scale)
            if start == 0:
                w.write_padding(w.fout[0], w.fout[0].tell())
            chunk.tofile(w.fout[0])
            written += chunk.nbytes
        w.write_padding(w.fout[0], rows * cols // block * size)
        w.tensors[0].pop(name)
    w.close()
    print(f"wrote {out}: {written / 1e9:.2f} GB of {qtype} weights in {time.perf_counter() - t0:.0f} s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--qtype", default="Q4_0", choices=sorted(_SCALES))
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the real model (default: all)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    shape = SHAPES[args.shape]
    if args.layers is not None:
        shape = Shape(**{**shape.__dict__, "layers": args.layers})
    write(args.out, shape, args.qtype, args.seed)


if __name__ == "__main__":
    main()
