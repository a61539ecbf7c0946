"""The sizes of a model that its device memory depends on, read from its transformers config: `ModelShape`, and the
LoRA adapters a run adds (`LoraShape`)."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig

from fastgrpo.config import GRPOConfig


def kv_dims(config: PretrainedConfig) -> tuple[int, int, int]:
    """``(layers, kv heads, head dim)`` of the decoder ``config`` describes (its text model's): what a KV cache holds
    per token (`fastgrpo.rollout.cache.RowCache`)."""
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return text.num_hidden_layers, heads, head_dim


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that memory depends on, read from its transformers config.

    ``qkv_bias``/``o_bias``: biases of the query/key/value and output projections (Qwen2 has the former only; Llama
    and Qwen3 follow ``attention_bias`` for all four); ``mlp_bias``: biases of the MLP (Llama's ``mlp_bias``);
    ``qk_norm``: an RMSNorm over the head dimension of queries and keys (Qwen3)."""

    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config: PretrainedConfig) -> ModelShape:
        """The shape of the model ``config`` describes (the text model's, for a multimodal config)."""
        text = config.get_text_config()
        family = text.model_type
        attention_bias = bool(getattr(text, "attention_bias", False))
        tied = getattr(text, "tie_word_embeddings", None)
        layers, kv_heads, head_dim = kv_dims(config)
        return cls(
            model_type=family,
            hidden_size=text.hidden_size,
            num_layers=layers,
            num_heads=text.num_attention_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=text.intermediate_size,
            vocab_size=text.vocab_size,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False) if tied is None else tied),
            qkv_bias=True if family == "qwen2" else attention_bias,
            o_bias=False if family == "qwen2" else attention_bias,
            mlp_bias=bool(getattr(text, "mlp_bias", False)),
            qk_norm=family == "qwen3",
        )

    @property
    def q_width(self) -> int:
        """Query (and attention output) features: heads x head dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Key (or value) features: KV heads x head dim."""
        return self.num_kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` features of each linear layer of a decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        return {
            "q_proj": (h, self.q_width),
            "k_proj": (h, self.kv_width),
            "v_proj": (h, self.kv_width),
            "o_proj": (self.q_width, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def biases(self) -> dict[str, bool]:
        """Whether each linear layer of a decoder layer has a bias."""
        qkv, mlp = self.qkv_bias, self.mlp_bias
        return {
            "q_proj": qkv,
            "k_proj": qkv,
            "v_proj": qkv,
            "o_proj": self.o_bias,
            "gate_proj": mlp,
            "up_proj": mlp,
            "down_proj": mlp,
        }

    def layer_params(self) -> int:
        """Parameters of one decoder layer: its linear layers (and biases), two RMSNorms, Qwen3's query/key norms."""
        linear = sum(i * o + (o if self.biases()[name] else 0) for name, (i, o) in self.linears().items())
        return linear + 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    def linear_weights(self) -> int:
        """Weight elements of every decoder layer's linear layers (no biases)."""
        return self.num_layers * sum(i * o for i, o in self.linears().values())

    @property
    def embedding_params(self) -> int:
        """Elements of the token embedding (and of an untied LM head)."""
        return self.vocab_size * self.hidden_size

    @property
    def kv_dims(self) -> tuple[int, int, int]:
        """``(layers, kv heads, head dim)``, as `kv_dims` reads them from the config."""
        return self.num_layers, self.num_kv_heads, self.head_dim

    def num_parameters(self) -> int:
        """All parameters of the causal LM, a tied LM head counted once (as ``model.parameters()`` does)."""
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.embedding_params + self.num_layers * self.layer_params() + self.hidden_size + head


@dataclass(frozen=True)
class LoraShape:
    """LoRA adapters on a model: ``params`` adapter parameters, ``adapted`` base-weight elements of the modules they
    adapt (the copies kept while merged into low-precision weights), ``modules`` the adapted module names."""

    params: int
    adapted: int
    modules: frozenset[str]


def lora_shape(shape: ModelShape, config: GRPOConfig) -> LoraShape:
    """The adapters `fastgrpo.grpo.policy.wrap_lora` adds: rank ``lora_r`` on every decoder linear layer (peft's
    ``all-linear``, which leaves the LM head out) or on the modules ``lora_target_modules`` names (by their last name
    component, as peft matches them; ``lm_head`` and ``embed_tokens`` too)."""
    r = config.lora_r
    names = {t.rsplit(".", 1)[-1] for t in config.lora_target_modules} if config.lora_target_modules else None
    linears = {n: io for n, io in shape.linears().items() if names is None or n in names}
    params = shape.num_layers * sum(r * (i + o) for i, o in linears.values())
    adapted = shape.num_layers * sum(i * o for i, o in linears.values())
    extra = {"lm_head", "embed_tokens"} & (names or set())
    for _ in extra:  # an embedding's adapter is r x (V + H), as a linear layer's
        params += r * (shape.vocab_size + shape.hidden_size)
        adapted += shape.embedding_params
    return LoraShape(params, adapted, frozenset(linears) | extra)
