"""A tiny llama with random weights, for trying llmgw offline: a GGUF, or a Hugging Face checkpoint.

Nothing it says is worth reading, but the engine loads it, tokenizes with it and
applies its chat template, and the planner sizes it from its config.json as from
any other model's: the whole path from a plan to a served request can be walked
without downloading a checkpoint. The GGUF form (Q8_0) is for llama-server; the
``hf`` form (bf16 safetensors, a byte-level BPE tokenizer.json) is for vLLM.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmgw.errors import ConfigError

Format = Literal["gguf", "hf"]
FORMATS: tuple[Format, ...] = ("gguf", "hf")
PRECISION = "q8_0"
RMS_EPS = 1e-5
ROPE_THETA = 10_000.0
WEIGHT_SCALE = 0.02
MAX_LAYERS = 32
MAX_EMBD = 2048  # 32 layers of 2048: ~1.7 GB, about as much as numpy should quantize in one go
MIN_CONTEXT, MAX_CONTEXT = 128, 1 << 20
QK8_0 = 32  # a Q8_0 block: rows must be a whole number of them
# The head sizes vLLM's CPU attention has kernels for that are multiples of 32 (80 and 112 take its
# 16-wide fallback), up to 256.
HF_HEAD_SIZES = (32, 64, 96, 128, 160, 192, 224, 256)
HF_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # Qwen's ChatML names: no BOS, EOS is <|im_end|>
HF_VOCAB = 2048  # what the BPE trainer may reach; the demo words give it fewer

# ChatML, which llama.cpp also recognises without --jinja; its markers are control tokens below.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_WORDS = """
the of and to a in is it you that he was for on are with as i his they be at one have this from or
had by hot word but what some we can out other were all there when up use your how said an each
she which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form sentence great think say help low line differ turn cause much mean before move
right boy old too same tell does set three want air well also play small end put home read hand
port large spell add even land here must big high such follow act why ask men change went light
kind off need house picture try us again animal point mother world near build self earth father
hello model token fleet server plan node replica llama demo test yes please thank
"""
_PUNCT = ".,!?;:'\"-()/"


@dataclass(frozen=True)
class DemoModel:
    """What write_demo_model wrote, and the figures it wrote them with."""

    format: Format
    weights: Path  # the GGUF, or model.safetensors
    config: Path
    file_bytes: int
    params: int
    context: int
    layers: int
    embd: int
    heads: int
    kv_heads: int
    ffn: int
    vocab_size: int
    files: tuple[Path, ...] = ()  # the hf form's tokenizer and generation files, beside config.json

    @property
    def gguf(self) -> Path:
        """The GGUF llama-server loads; the hf form has none."""
        if self.format != "gguf":
            raise ValueError(f"the {self.format} demo model in {self.weights.parent} has no GGUF")
        return self.weights


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """SentencePiece-style pieces, scores and token types: specials, 256 byte tokens, then pieces."""
    from gguf import TokenType

    specials = [("<unk>", TokenType.UNKNOWN), ("<s>", TokenType.CONTROL), ("</s>", TokenType.CONTROL),
                ("<|im_start|>", TokenType.CONTROL), ("<|im_end|>", TokenType.CONTROL)]
    pieces: dict[str, None] = {}
    singles = "abcdefghijklmnopqrstuvwxyz0123456789" + _PUNCT
    for ch in ["▁", *singles, *("▁" + c for c in singles)]:
        pieces[ch] = None
    # Every prefix too: llama.cpp's SPM tokenizer only merges pairs whose concatenation is a piece.
    for word in _WORDS.split():
        for end in range(2, len(word) + 1):
            pieces["▁" + word[:end]] = None
    tokens = [t for t, _ in specials] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    types = [int(k) for _, k in specials] + [int(TokenType.BYTE)] * 256 + [int(TokenType.NORMAL)] * len(pieces)
    return tokens, scores, types


def _near(embd: int) -> str:
    below = min(MAX_EMBD, max(QK8_0, embd // QK8_0 * QK8_0))
    above = below + QK8_0
    return f"{below} or --embd {above}" if below < embd < above <= MAX_EMBD else str(below)


def _check(format: Format, context: int, layers: int, embd: int, heads: int, kv_heads: int) -> None:
    if format not in FORMATS:
        raise ConfigError(f"--format {format!r} is not one of {', '.join(FORMATS)}")
    if not MIN_CONTEXT <= context <= MAX_CONTEXT:
        raise ConfigError(f"--context {context} is outside {MIN_CONTEXT}..{MAX_CONTEXT}; pass e.g. --context 2048")
    if not 1 <= layers <= MAX_LAYERS:
        raise ConfigError(f"--layers {layers} is outside 1..{MAX_LAYERS}; pass e.g. --layers 2")
    if format == "hf":
        _check_hf(embd, heads)
    else:
        if not QK8_0 <= embd <= MAX_EMBD or embd % QK8_0:
            raise ConfigError(f"--embd {embd}: Q8_0 stores rows in blocks of {QK8_0}, so the embedding must be a "
                              f"multiple of {QK8_0} from {QK8_0} to {MAX_EMBD}; pass e.g. --embd {_near(embd)}")
        if heads < 1 or embd % heads or (embd // heads) % 2:
            fits = [h for h in (1, 2, 4, 8, 16, 32) if embd % h == 0 and (embd // h) % 2 == 0]
            raise ConfigError(f"--heads {heads} does not split --embd {embd} into heads of an even width (RoPE "
                              f"rotates pairs); pass one of {', '.join(map(str, fits))}")
    if kv_heads < 1 or heads % kv_heads:
        fits = [k for k in range(1, heads + 1) if heads % k == 0]
        raise ConfigError(f"--kv-heads {kv_heads} does not group {heads} attention heads evenly; "
                          f"pass one of {', '.join(map(str, fits))}")


def _check_hf(embd: int, heads: int) -> None:
    if not QK8_0 <= embd <= MAX_EMBD or embd % QK8_0:
        raise ConfigError(f"--embd {embd}: vLLM's CPU attention needs heads of a multiple of 32, so the embedding "
                          f"must be a multiple of 32 from 32 to {MAX_EMBD}; pass e.g. --embd {_near(embd)}")
    if heads < 1 or embd % heads or embd // heads not in HF_HEAD_SIZES:
        fits = [h for h in range(1, embd // 32 + 1) if embd % h == 0 and embd // h in HF_HEAD_SIZES]
        width = f"heads of {embd // heads}" if heads >= 1 and embd % heads == 0 else "unequal heads"
        raise ConfigError(f"--heads {heads} splits --embd {embd} into {width}; vLLM's CPU attention has kernels for "
                          f"head sizes {', '.join(map(str, HF_HEAD_SIZES))} only: pass --heads "
                          f"{' or '.join(map(str, fits))}, or --embd {heads * 32 if heads >= 1 else 128}")


def _config(*, context: int, layers: int, embd: int, heads: int, kv_heads: int, ffn: int, vocab: int,
            dtype: str, bos: int, eos: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": embd,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": embd // heads,
        "max_position_embeddings": context,
        "vocab_size": vocab,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": ROPE_THETA,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": dtype,
        "bos_token_id": bos,
        "eos_token_id": eos,
    }


def write_json(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def write_demo_model(dir: Path, *, format: Format = "gguf", context: int = 2048, layers: int = 2,
                     embd: int | None = None, heads: int = 4, kv_heads: int = 2, seed: int = 0,
                     name: str = "llmgw-demo") -> DemoModel:
    """Write a random-weight llama into ``dir``: a Q8_0 GGUF and its config.json, or (``hf``) a checkpoint vLLM loads.

    ``embd`` defaults to 64 for the GGUF and 128 for ``hf``, whose heads must be 32 wide or more.
    """
    embd = embd if embd is not None else (128 if format == "hf" else 64)
    _check(format, context, layers, embd, heads, kv_heads)
    if format == "hf":
        return _write_hf(dir, context=context, layers=layers, embd=embd, heads=heads, kv_heads=kv_heads, seed=seed)
    try:
        import gguf
        import numpy as np
    except ImportError as e:
        raise ConfigError(f"writing a GGUF needs the gguf package ({e}); pip install 'llmgw[demo]'") from e

    ffn, head_dim = 4 * embd, embd // heads
    tokens, scores, types = vocabulary()
    vocab = len(tokens)
    dir.mkdir(parents=True, exist_ok=True)
    # The name the planner gives the file it tells llama-server to load (planner.gguf_file):
    # the model is named after its folder, Org__Name standing for Org/Name.
    stem = dir.resolve().name.replace("__", "/", 1).split("/")[-1]
    path = dir / f"{stem}-{PRECISION.upper()}.gguf"

    rng = np.random.default_rng(seed)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def matrix(rows: int, cols: int) -> np.ndarray:
        # numpy's (rows, cols) is ggml's ne = [cols, rows]: cols is the row a Q8_0 block walks.
        w = (rng.standard_normal((rows, cols), dtype=np.float32) * WEIGHT_SCALE).astype(np.float32)
        return gguf.quants.quantize(w, q8)

    ones = np.ones(embd, dtype=np.float32)
    weights: list[tuple[str, np.ndarray]] = [("token_embd.weight", matrix(vocab, embd))]
    for i in range(layers):
        weights += [
            (f"blk.{i}.attn_norm.weight", ones),
            (f"blk.{i}.attn_q.weight", matrix(heads * head_dim, embd)),
            (f"blk.{i}.attn_k.weight", matrix(kv_heads * head_dim, embd)),
            (f"blk.{i}.attn_v.weight", matrix(kv_heads * head_dim, embd)),
            (f"blk.{i}.attn_output.weight", matrix(embd, heads * head_dim)),
            (f"blk.{i}.ffn_norm.weight", ones),
            (f"blk.{i}.ffn_gate.weight", matrix(ffn, embd)),
            (f"blk.{i}.ffn_up.weight", matrix(ffn, embd)),
            (f"blk.{i}.ffn_down.weight", matrix(embd, ffn)),
        ]
    weights += [("output_norm.weight", ones), ("output.weight", matrix(vocab, embd))]

    # Written beside the target and renamed: an interrupted run leaves no half file under the real name.
    tmp = path.with_name(path.name + ".partial")
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(name)
    w.add_context_length(context)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(RMS_EPS)
    w.add_rope_freq_base(ROPE_THETA)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    for tensor_name, data in weights:
        w.add_tensor(tensor_name, data, raw_dtype=q8 if data.dtype == np.uint8 else None)
    params = w.get_total_parameter_count()[0]
    write_gguf_file(w, tmp, path)

    config_path = write_json(dir / "config.json", _config(
        context=context, layers=layers, embd=embd, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
        dtype="float16", bos=1, eos=2))
    return DemoModel(format="gguf", weights=path, config=config_path, file_bytes=path.stat().st_size,
                     params=params, context=context, layers=layers, embd=embd, heads=heads, kv_heads=kv_heads,
                     ffn=ffn, vocab_size=vocab)


def write_gguf_file(w: Any, tmp: Path, path: Path) -> None:
    """Write a filled ``gguf.GGUFWriter`` (opened on ``tmp``) and rename it to ``path``: an interrupted
    run leaves no half file under the real name, and ``tmp`` is gone either way."""
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)


def hf_tokenizer() -> Any:
    """A byte-level BPE (GPT-2's scheme, as Llama 3 and Qwen use) trained on the demo words: any text round-trips."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        raise ConfigError(f"writing the hf demo model needs the tokenizers package ({e}); "
                          "pip install 'llmgw[demo]'") from e
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=HF_VOCAB, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=list(HF_SPECIALS))
    words = _WORDS.split()
    # Each word alone, after a space and capitalised: the trainer counts pre-tokenized words, and
    # " hello" is another word than "hello" to a byte-level BPE.
    tok.train_from_iterator([*words, " ".join(words), " ".join(w.capitalize() for w in words), _PUNCT], trainer)
    return tok


def bf16_bytes(w: Any) -> bytes:
    """float32 to bfloat16, rounded to nearest even: numpy has no bfloat16, and its bits are float32's top half."""
    import numpy as np

    bits = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2").tobytes()


def write_safetensors(path: Path, tensors: Iterable[tuple[str, tuple[int, ...]]], data: Iterable[bytes]) -> None:
    """A JSON header of names, dtypes, shapes and offsets, then the bf16 tensors back to back (no torch needed)."""
    header: dict[str, Any] = {}
    offset = 0
    for tensor_name, shape in tensors:
        size = 2 * math.prod(shape)
        header[tensor_name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the tensors start 8-byte aligned
    tmp = path.with_name(path.name + ".partial")
    try:
        with tmp.open("wb") as f:
            f.write(struct.pack("<Q", len(raw)))
            f.write(raw)
            for chunk in data:
                f.write(chunk)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _write_hf(dir: Path, *, context: int, layers: int, embd: int, heads: int, kv_heads: int,
              seed: int) -> DemoModel:
    try:
        import numpy as np
    except ImportError as e:
        raise ConfigError(f"writing the hf demo model needs numpy ({e}); pip install 'llmgw[demo]'") from e
    tok = hf_tokenizer()
    vocab = tok.get_vocab_size(with_added_tokens=True)
    bos, eos = tok.token_to_id(HF_SPECIALS[0]), tok.token_to_id(HF_SPECIALS[2])
    ffn, head_dim = 4 * embd, embd // heads

    # Hugging Face's Llama names and [out, in] shapes, which vLLM's loader maps onto its layers.
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, embd))]
    for i in range(layers):
        at = f"model.layers.{i}"
        shapes += [
            (f"{at}.input_layernorm.weight", (embd,)),
            (f"{at}.self_attn.q_proj.weight", (heads * head_dim, embd)),
            (f"{at}.self_attn.k_proj.weight", (kv_heads * head_dim, embd)),
            (f"{at}.self_attn.v_proj.weight", (kv_heads * head_dim, embd)),
            (f"{at}.self_attn.o_proj.weight", (embd, heads * head_dim)),
            (f"{at}.post_attention_layernorm.weight", (embd,)),
            (f"{at}.mlp.gate_proj.weight", (ffn, embd)),
            (f"{at}.mlp.up_proj.weight", (ffn, embd)),
            (f"{at}.mlp.down_proj.weight", (embd, ffn)),
        ]
    shapes += [("model.norm.weight", (embd,)), ("lm_head.weight", (vocab, embd))]
    rng = np.random.default_rng(seed)

    def tensors() -> Iterable[bytes]:
        # One at a time: 32 layers of 2048 would hold ~1.7 GB of float32 at once.
        for _, shape in shapes:
            if len(shape) == 1:
                yield bf16_bytes(np.ones(shape, dtype=np.float32))  # RMSNorm's gain: 1 leaves activations as they are
            else:
                yield bf16_bytes(rng.standard_normal(shape, dtype=np.float32) * WEIGHT_SCALE)

    dir.mkdir(parents=True, exist_ok=True)
    weights = dir / "model.safetensors"
    write_safetensors(weights, shapes, tensors())
    tokenizer = dir / "tokenizer.json"
    tok.save(str(tokenizer))
    files = (
        tokenizer,
        write_json(dir / "tokenizer_config.json", {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": None,
            "eos_token": HF_SPECIALS[2],
            "pad_token": HF_SPECIALS[0],
            "unk_token": None,
            "add_bos_token": False,
            "add_eos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": context,
            "chat_template": CHAT_TEMPLATE,
        }),
        write_json(dir / "generation_config.json", {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": bos}),
    )
    config = write_json(dir / "config.json", _config(
        context=context, layers=layers, embd=embd, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
        dtype="bfloat16", bos=bos, eos=eos))
    params = sum(math.prod(shape) for _, shape in shapes)
    return DemoModel(format="hf", weights=weights, config=config, file_bytes=weights.stat().st_size, params=params,
                     context=context, layers=layers, embd=embd, heads=heads, kv_heads=kv_heads, ffn=ffn,
                     vocab_size=vocab, files=files)
