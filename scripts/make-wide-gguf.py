#!/usr/bin/env python3
"""A random Llama with SmolLM2's tokenizer and rows wide enough for the k-quants, for speed
comparisons only (its answers are noise): `llama-quantize` turns it into a Q4_K_M file whose
projections are all k-quants, which SmolLM2's own rows (576 wide, not a multiple of 256) cannot
be.

    ~/.cache/mole/venv-quant/bin/pip install numpy gguf
    ~/.cache/mole/venv-quant/bin/python scripts/make-wide-gguf.py <SmolLM2 .gguf> <out f16 .gguf>
    llama-quantize <out f16 .gguf> <out Q4_K_M .gguf> Q4_K_M
    python3 scripts/make-wide-gguf.py --adapter <dir>   # a rank-8 PEFT LoRA for it (numpy only)

Hidden 1024, MLP 2816 (both multiples of 256), 16 heads of 64 over 4 KV heads, 10 layers, the
output head tied to the embedding as SmolLM2's; weights normal with deviation 0.02, norms 1,
in f16. Every metadata key of the source but the shape's and the file type's is copied, so
the tokenizer and chat template are SmolLM2's and guidellm can count tokens with its import.

A model all noise samples any token, special ones and stray bytes included, which llama-server's
chat parser refuses mid-stream: every embedding carries a constant first dimension (so the
residual stream and the final norm's output always have a large one) and the token " the"
a far larger one, so its tied logit leads by tens and it is the answer, sampled or greedy.

`--adapter DIR` writes a PEFT LoRA of this shape as the demo adapter is made (rank 8, alpha 16,
`q_proj` and `v_proj` of every layer, f32), random and small enough to leave the answer " the",
so `MOLE_BENCH_ADAPTER=DIR scripts/bench-llama.sh mole-gguf-lora` times a LoRA on this base.
"""
import json
import os
import sys

import numpy as np
import gguf

H, I, L, NH, NKV, HD = 1024, 2816, 10, 16, 4, 64
SHAPE = {
    "llama.block_count": L,
    "llama.embedding_length": H,
    "llama.feed_forward_length": I,
    "llama.attention.head_count": NH,
    "llama.attention.head_count_kv": NKV,
    "llama.rope.dimension_count": HD,
}


def main(src, out):
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(out, "llama")
    vocab = None
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key == "llama.vocab_size":
            vocab = int(f.contents())
        vtype = f.types[0]
        if key in SHAPE:
            w.add_uint32(key, SHAPE[key])
        elif key == "general.file_type":
            w.add_uint32(key, int(gguf.LlamaFileType.MOSTLY_F16))
        elif vtype == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, f.contents(), vtype, sub_type=f.types[-1])
        else:
            w.add_key_value(key, f.contents(), vtype)
    rng = np.random.default_rng(33)

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16)

    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    the = tokens.index("\u0120the")
    emb = rand(vocab, H)
    emb[:, 0] = 1.0
    emb[the, 0] = 20.0
    w.add_tensor("token_embd.weight", emb)
    w.add_tensor("output_norm.weight", np.ones(H, dtype=np.float32))
    for b in range(L):
        p = f"blk.{b}."
        w.add_tensor(p + "attn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(H, dtype=np.float32))
        w.add_tensor(p + "attn_q.weight", rand(NH * HD, H))
        w.add_tensor(p + "attn_k.weight", rand(NKV * HD, H))
        w.add_tensor(p + "attn_v.weight", rand(NKV * HD, H))
        w.add_tensor(p + "attn_output.weight", rand(H, NH * HD))
        w.add_tensor(p + "ffn_gate.weight", rand(I, H))
        w.add_tensor(p + "ffn_up.weight", rand(I, H))
        w.add_tensor(p + "ffn_down.weight", rand(H, I))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def adapter(out):
    """A rank-8 LoRA on `q_proj` and `v_proj`, written as PEFT writes one (safetensors by hand:
    an 8-byte little-endian header length, the JSON header, then the tensors' bytes)."""
    r = 8
    rng = np.random.default_rng(1)
    tensors = {}
    for i in range(L):
        for mod, d_out in (("q_proj", NH * HD), ("v_proj", NKV * HD)):
            p = f"base_model.model.model.layers.{i}.self_attn.{mod}."
            tensors[p + "lora_A.weight"] = rng.normal(0, 0.02, (r, H)).astype(np.float32)
            tensors[p + "lora_B.weight"] = rng.normal(0, 0.002, (d_out, r)).astype(np.float32)
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        b = tensors[name].tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(b)]}
        offset += len(b)
        blobs.append(b)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "adapter_model.safetensors"), "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + b"".join(blobs))
    config = {
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "lora_alpha": 16,
        "lora_dropout": 0.0,
        "peft_type": "LORA",
        "r": r,
        "target_modules": ["q_proj", "v_proj"],
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    with open(os.path.join(out, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)


if __name__ == "__main__":
    if sys.argv[1] == "--adapter":
        adapter(sys.argv[2])
    else:
        main(*sys.argv[1:3])
