"""Options of speculative rollouts (`SpeculationConfig`, the ``speculation.*`` keys) and of draft learning
(`DraftTrainConfig`, ``draft_training.*``)."""

from __future__ import annotations

from dataclasses import dataclass

from fastgrpo.fields import Range, check_ranges, option

LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")
# A verification forward holds rows x nodes tokens: past a few hundred per row it costs far more than it can win.
MAX_TREE_NODES = 256
MAX_TREE_DEPTH = 32


@dataclass
class ControllerLimits:
    """The paper's constants: ``n_max`` verified tokens per row, ``k_max`` children per node, ``l_min``..``l_max``
    levels, and ``alpha`` (expected acceptance) in the depth rule."""

    n_max: int = 64
    k_max: int = 8
    l_min: int = 3
    l_max: int = 5
    alpha: float = 0.75

    def validate(self, prefix: str = "") -> None:
        """Raise ValueError naming the first bad constant (``prefix`` + its name, e.g. ``speculation.n_max``)."""
        for name in ("n_max", "k_max", "l_min"):
            if getattr(self, name) < 1:
                raise ValueError(f"{prefix}{name} must be >= 1, got {getattr(self, name)}")
        if self.l_max < self.l_min:
            raise ValueError(f"{prefix}l_max must be >= {prefix}l_min, got {self.l_max} < {self.l_min}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"{prefix}alpha must be in (0, 1], got {self.alpha}")


SPECULATION_MODES = ("off", "static", "paper", "adaptive")


@dataclass
class SpeculationConfig:
    """Speculative rollouts (lossless: they change how fast completions come, not what they are).

    ``mode``: ``off``; ``static`` (trees of a fixed shape: ``nodes`` verified tokens per row, the root included,
    ``top_k`` children per expanded node, ``depth`` levels; ``nodes: 1`` is plain decoding); ``paper`` (FastGRPO's
    rule: ``nodes = c_peak // active rows``, clamped by ``n_max``, ``k_max``, ``l_min``, ``l_max`` and ``alpha``);
    ``adaptive`` (the tree of the highest predicted goodput at every step, plain steps when no tree pays).
    ``drafter``: who drafts the trees: ``eagle`` (the learned draft head), ``suffix`` (continuations of the prompt's
    earlier completions and of the group's, no neural forward; ``suffix_memory_tokens`` bounds what it keeps), or
    both, ``eagle+suffix``, between which the adaptive controller chooses at every step, merged trees of both
    included (a static or paper tree merges both).
    ``c_peak``: the verification capacity in tokens, or ``auto`` to read this model's saved ``fastgrpo profile``
    (a short calibration of a few forwards when there is none). ``draft``: a directory saved by ``fastgrpo draft
    train`` (None: a fresh, untrained draft). ``draft_vocab_size``: a fresh draft gets a reduced vocabulary, the at
    most this many most frequent tokens of the first rollout's completions (that rollout drafts with the other
    drafters only, or runs plain, as a random draft could not speed it up), so that drafting and online draft learning
    do not pay for the full LM head."""

    mode: str = option(
        "adaptive",
        help="`off` (plain decoding), `static` (one tree shape), `paper` (FastGRPO's rule from c_peak and the active "
        "rows) or `adaptive` (the tree of the highest predicted goodput at every step, plain steps when none pays)",
        choices=SPECULATION_MODES,
    )
    drafter: str = option(
        "eagle+suffix",
        help="who drafts: `eagle` (the learned draft head), `suffix` (earlier completions, no neural forward) or "
        "both, as a list `[eagle, suffix]` or joined `eagle+suffix` (the controller picks either or a merged tree at "
        "every step)",
        joins="+",
    )
    suffix_memory_tokens: int = option(
        2_000_000, help="`suffix`: earlier completions' tokens kept (about 50 bytes each)", valid=Range(0, 2**40)
    )
    draft: str | None = option(
        None,
        help="a directory saved by `fastgrpo draft train`, or a checkpoint's `draft` directory (the drafters' state, "
        "of fastgrpo's trainer or the TRL integration); None: a fresh draft; refused with mode off",
        path=True,
    )
    draft_vocab_size: int | None = option(
        None,
        help="a fresh draft's reduced vocabulary: the most frequent tokens of the first rollout (which the other "
        "drafters draft alone)",
    )
    nodes: int = option(
        16,
        help="`static`: verified tokens per row, the root included (1: plain decoding)",
        valid=Range(1, MAX_TREE_NODES),
    )
    top_k: int = option(4, help="`static`: children per expanded node", valid=Range(1, MAX_TREE_NODES))
    depth: int = option(5, help="`static`: tree levels", valid=Range(1, MAX_TREE_DEPTH))
    c_peak: int | str = option(
        "auto", help="verification capacity in tokens, or `auto`: the saved `fastgrpo profile` or a short calibration"
    )
    n_max: int = option(64, help="most verified tokens per row (`paper`, `adaptive`)")
    k_max: int = option(8, help="most children per node (`paper`, `adaptive`)")
    l_min: int = option(3, help="fewest tree levels (`paper`, `adaptive`)")
    l_max: int = option(5, help="most tree levels (`paper`, `adaptive`)")
    alpha: float = option(0.75, help="expected acceptance in the paper's depth rule")

    def limits(self) -> ControllerLimits:
        """The constants of the paper's rule (and the adaptive controller's bounds)."""
        return ControllerLimits(self.n_max, self.k_max, self.l_min, self.l_max, self.alpha)

    def check_given(self, given: dict) -> None:
        """Refuse a saved draft (``speculation.draft``) the user set that ``mode: off`` leaves unused."""
        if self.mode == "off" and given.get("draft") is not None:
            raise ValueError(
                "speculation.draft has no effect with speculation.mode: off (nothing is drafted, no draft is read): "
                "remove it, or choose a mode that speculates"
            )

    def validate(self) -> None:
        if self.mode not in SPECULATION_MODES:
            raise ValueError(f"speculation.mode must be one of {list(SPECULATION_MODES)}, got {self.mode!r}")
        if not self.drafter or any(not name for name in self.drafter.split("+")):
            raise ValueError(f"speculation.drafter must name drafters joined by '+', got {self.drafter!r}")
        check_ranges(self, "speculation.")
        self.limits().validate("speculation.")
        if self.c_peak != "auto" and not (isinstance(self.c_peak, int) and self.c_peak >= 1):
            raise ValueError(f"speculation.c_peak must be 'auto' or an integer >= 1, got {self.c_peak!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 2:
            raise ValueError(f"speculation.draft_vocab_size must be >= 2, got {self.draft_vocab_size}")
        if self.draft_vocab_size is not None and self.draft is not None:
            raise ValueError(
                "speculation.draft_vocab_size applies to a fresh draft; the saved draft in speculation.draft "
                f"({self.draft}) keeps its own vocabulary"
            )


@dataclass
class DraftTrainConfig:
    """Draft training options. Online (during GRPO, when speculation is on): ``online`` trains the draft on every
    rollout, ``epochs`` passes over it per step. The learning-rate schedule (transformers' ``get_scheduler``) spans
    one `DraftTrainer.fit` call: the whole of an offline fit, or one step's passes online."""

    online: bool = option(True, help="train the draft on every rollout while speculation is on")
    learning_rate: float = option(1e-4, help="the draft's AdamW learning rate")
    hidden_loss_weight: float = option(2.0, help="weight of the SmoothL1 loss on the predicted hidden state")
    token_loss_weight: float = option(0.1, help="weight of the soft cross-entropy against the target's next token")
    token_budget: int = option(2048, help="tokens per draft training batch (sequences are packed up to it)")
    epochs: int = option(1, help="passes over each rollout (online) or the whole data set (offline)")
    max_grad_norm: float = option(1.0, help="gradient clipping of the draft")
    bf16: bool = option(False, help="bfloat16 autocast for the draft's forward and backward")
    unroll: int = option(
        1, help="tree depths trained per position, feeding the draft its own predictions (1: teacher forcing only)"
    )
    lr_scheduler_type: str = option(
        "constant", help="learning-rate schedule over one fit (transformers' get_scheduler)", choices=LR_SCHEDULERS
    )
    warmup_ratio: float = option(0.0, help="share of a fit's optimizer steps spent warming the learning rate up")
    min_share: float = option(
        0.25,
        help="online: share of a rollout's completions the draft trains on when the rollout ran no tree; the share "
        "follows the share of decoding steps that ran a tree, up to all (1.0: always all)",
    )

    def validate(self) -> None:
        for name in ("learning_rate", "token_budget", "epochs", "max_grad_norm", "unroll"):
            if getattr(self, name) <= 0:
                raise ValueError(f"draft_training.{name} must be > 0, got {getattr(self, name)}")
        if self.hidden_loss_weight < 0 or self.token_loss_weight < 0:
            raise ValueError("draft_training loss weights must be >= 0")
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            raise ValueError(
                f"draft_training.lr_scheduler_type must be one of {list(LR_SCHEDULERS)}, got {self.lr_scheduler_type!r}"
            )
        if not 0 <= self.warmup_ratio <= 1:
            raise ValueError(f"draft_training.warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if not 0 < self.min_share <= 1:
            raise ValueError(f"draft_training.min_share must be in (0, 1], got {self.min_share}")
