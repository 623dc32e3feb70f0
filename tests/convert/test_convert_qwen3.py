"""convert on a random Qwen3ForCausalLM checkpoint with the real Qwen 3 tokenizer: a
qwen3 GGUF whose q/k rows are HF's (NEOX: no permutation), with q/k norms, key_length,
the qwen2 pre-tokenizer and Qwen 3's chat template; it runs as the reference says."""
import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader

import edgellama
from edgellama.quant.convert import convert
from hf_fixtures import write_safetensors
from reference import load_reference, reference_forward

VOCAB = 151936


def write_tiny_qwen3(d: Path, tok_dir: Path, *, hidden=64, layers=2, heads=4, kv_heads=2,
                     head_dim=32, ffn=128, seed=0) -> tuple[Path, dict]:
    """A random Qwen3ForCausalLM (head dim 2·hidden/heads, as 0.6B's), tied, f32; its
    tensors by HF name."""
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": ffn,
        "vocab_size": VOCAB, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": True,
        "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"}))

    def w(*shape, s=0.02):
        return rng.normal(0, s, size=shape).astype(np.float32)

    def norm(n):
        return 1 + rng.normal(0, 0.1, n).astype(np.float32)

    t = {"model.embed_tokens.weight": w(VOCAB, hidden, s=1.0), "model.norm.weight": norm(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": norm(hidden),
              p + "post_attention_layernorm.weight": norm(hidden),
              p + "self_attn.q_proj.weight": w(heads * head_dim, hidden, s=0.5),
              p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden, s=0.5),
              p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden, s=0.1),
              p + "self_attn.o_proj.weight": w(hidden, heads * head_dim, s=0.1),
              p + "self_attn.q_norm.weight": norm(head_dim),
              p + "self_attn.k_norm.weight": norm(head_dim),
              p + "mlp.gate_proj.weight": w(ffn, hidden, s=0.1),
              p + "mlp.up_proj.weight": w(ffn, hidden, s=0.1),
              p + "mlp.down_proj.weight": w(hidden, ffn, s=0.1)}
    write_safetensors(d / "model.safetensors", t, "f32")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, d / f)
    return d, t


@pytest.fixture(scope="module")
def converted(qwen3_tokenizer_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    hf_dir, tensors = write_tiny_qwen3(d / "hf", qwen3_tokenizer_dir)
    out = d / "q.gguf"
    convert(hf_dir, out, "f32")
    return out, tensors


def test_the_file_is_qwen3_with_hf_rows(converted):
    out, hf = converted
    r = GGUFReader(str(out))
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("tokenizer.ggml.t")}
    assert meta["general.architecture"] == "qwen3"
    assert meta["qwen3.attention.key_length"] == meta["qwen3.rope.dimension_count"] == 32
    assert meta["tokenizer.ggml.pre"] == "qwen2" and "<think>" in meta["tokenizer.chat_template"]
    t = {x.name: np.asarray(x.data).reshape(tuple(int(n) for n in reversed(x.shape)))
         for x in r.tensors}
    assert "output.weight" not in t                          # tied
    for gguf_name, hf_name in (("blk.1.attn_q", "layers.1.self_attn.q_proj"),
                               ("blk.1.attn_k", "layers.1.self_attn.k_proj"),
                               ("blk.0.attn_q_norm", "layers.0.self_attn.q_norm"),
                               ("blk.0.attn_k_norm", "layers.0.self_attn.k_norm")):
        # NEOX: HF's rows, not permuted
        np.testing.assert_array_equal(t[gguf_name + ".weight"], hf[f"model.{hf_name}.weight"])


def test_it_runs_as_the_reference(converted):
    out, _ = converted
    llm = edgellama.load(out, ctx=64)
    ids = llm.chat.encode_messages([{"role": "user", "content": "Hi, 2+2?"}])
    assert ids[0] == 151644                      # <|im_start|>: no BOS
    assert llm.tokenizer.decode(ids[-3:], special=True) == "<|im_start|>assistant\n"
    got = llm.model.forward(ids, llm.seq, all_logits=True)
    meta, W = load_reference(out)
    want = reference_forward(meta, W, ids)
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python not installed (pip install -e '.[oracle]')")
def test_llama_cpp_runs_the_converted_file_to_our_logits(converted):
    # the file convert wrote, with the real Qwen 3 tokenizer, read by llama.cpp itself: the
    # same token ids from the same text and the same F32 logits (KL within 1e-5)
    import llama_cpp
    out, _ = converted
    llm = edgellama.load(out, ctx=64)
    text = "Hi, 2+2? 汉字 and code: def f(x): return x**2"
    L = llama_cpp.Llama(model_path=str(out), n_ctx=64, n_batch=64, logits_all=True,
                        verbose=False, n_threads=2)
    ids = llm.tokenizer.encode(text)
    assert L.tokenize(text.encode(), add_bos=False, special=False) == ids
    L.eval(ids)
    theirs = np.array(L.scores[:len(ids)], np.float64)
    ours = llm.model.forward(ids, llm.seq, all_logits=True).astype(np.float64)
    lp = theirs - theirs.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq = ours - ours.max(-1, keepdims=True)
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    assert float((np.exp(lp) * (lp - lq)).sum(-1).max()) < 1e-5
