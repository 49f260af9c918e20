"""A tiny llama-architecture model with random (seeded) F32 weights, written with ``gguf``
(llama.cpp's own GGUF writer), so a real engine can serve it without downloading a model.

The vocabulary is SentencePiece-style (tokenizer model ``llama``): the three special tokens,
the newline byte token, the space mark, every printable ASCII character but ``<`` (so generated
text never starts to look like ``</s>``, a stop string some servers hold text back for) and a
few hundred merges. Prompts and the chat template must use only those characters: llama.cpp
aborts on a character that has neither a token nor a byte token.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

UNK, BOS, EOS = 0, 1, 2
SPECIAL_IDS = (UNK, BOS, EOS)
SPACE = "\u2581"                     # SentencePiece's space mark
# Roles and contents as plain lines: every character is in the vocabulary.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)
_FREQUENT = "etaoinshrdlucmfw"      # merges among the most frequent English letters


@dataclass(frozen=True)
class ModelShape:
    # 4 x 768 (111 MB, written in about a second): 5-7 ms a token on one thread of a busy
    # 2-core AMD EPYC, an ITL like a real engine's; 4 x 512 took 1.4-2.3 ms.
    layers: int = 4
    width: int = 768
    heads: int = 12
    ffn: int = 2048
    context: int = 2048


def vocabulary() -> tuple[list[str], list[float], list[gguf.TokenType]]:
    """(tokens, scores, types): about 350 tokens."""
    tokens = ["<unk>", "<s>", "</s>", "<0x0A>", SPACE]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL,
             gguf.TokenType.BYTE, gguf.TokenType.NORMAL]
    chars = [c for c in string.printable if c.isprintable() and c not in " <"]
    merges = [SPACE + c for c in string.ascii_lowercase]
    merges += [a + b for a in _FREQUENT for b in _FREQUENT]
    tokens += chars + merges
    types += [gguf.TokenType.NORMAL] * (len(chars) + len(merges))
    # SentencePiece merges the adjacent pair whose joined token scores highest.
    scores = [0.0] * 5 + [-1000.0] * len(chars) + [-float(i) for i in range(len(merges))]
    return tokens, scores, types


def write_model(path: Path, shape: ModelShape = ModelShape(), seed: int = 19) -> Path:
    """Write the model to ``path`` and return it."""
    tokens, scores, types = vocabulary()
    rng = np.random.default_rng(seed)
    n, ff = shape.width, shape.ffn

    def weights(*dims: int) -> np.ndarray:
        # numpy's (rows, cols) is GGML's (cols, rows): (out, in) for a matrix
        return (rng.standard_normal(dims) * 0.02).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("streamquake-tiny")
    w.add_context_length(shape.context)
    w.add_embedding_length(n)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.heads)
    w.add_rope_dimension_count(n // shape.heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(UNK)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    ones = np.ones(n, dtype=np.float32)
    w.add_tensor("token_embd.weight", weights(len(tokens), n))
    for i in range(shape.layers):
        w.add_tensor(f"blk.{i}.attn_norm.weight", ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            w.add_tensor(f"blk.{i}.{name}.weight", weights(n, n))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", ones)
        w.add_tensor(f"blk.{i}.ffn_gate.weight", weights(ff, n))
        w.add_tensor(f"blk.{i}.ffn_up.weight", weights(ff, n))
        w.add_tensor(f"blk.{i}.ffn_down.weight", weights(n, ff))
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", weights(len(tokens), n))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
