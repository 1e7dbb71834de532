"""Quest-style query-aware sparse read (:mod:`kvlab.kernels.quest`): the whole cache is kept; each
decode step reads only the ``budget`` tokens of the pages whose key min/max bound the query's
attention highest (the first and the latest page always). It saves bytes read, not memory.

On ``hf`` a :class:`~kvlab.policies.quest_layer.QuestLayer` per layer and kvlab's attention wrapper
(:mod:`kvlab.policies.attention`) hand each decode query to the layer; on ``fast`` the engine's
Quest store selects pages on the device and the sparse kernel reads them. Tang et al. 2024,
github.com/mit-han-lab/Quest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvlab.kernels import quest
from kvlab.kernels.quest_decode import kernel_problem
from kvlab.policies import attention
from kvlab.policies.base import Policy, PolicyError, check_int, hf_model, model_shape, on_cuda
from kvlab.policies.full import FullPolicy
from kvlab.policies.quest_layer import quest_cache

GROUP_REDUCE = ("max", "sum")


@dataclass(frozen=True)
class QuestPolicy(Policy):
    name = "quest"
    summary = ("Quest-style sparse read: the whole cache kept, each decode step reads the pages a key "
               "min/max bound ranks highest for the query (fast: sparse kernel)")

    page: int = field(default=16, metadata={"help": "tokens per page (a power of two; the CUDA kernel needs >= 16)"})
    budget: int = field(default=2048, metadata={
        "help": "tokens read per decode step (whole pages, at least 2: the first and the latest are always read)"})
    group_reduce: str = field(default="max", metadata={
        "help": "how a KV head's query heads rank pages together: max or sum of their bounds"})
    dense_layers: int = field(default=2, metadata={"help": "leading layers that read the whole cache (Quest: 2)"})

    def __post_init__(self):
        super().__post_init__()
        check_int("page", self.page, minimum=1)
        if self.page & (self.page - 1):
            raise PolicyError(f"page must be a power of two (16 is Quest's), got {self.page}")
        check_int("budget", self.budget)
        if self.budget < 2 * self.page:
            raise PolicyError(f"budget={self.budget} tokens must hold two pages of {self.page} (the first and the "
                              f"latest are always read): use >= {2 * self.page}")
        if self.group_reduce not in GROUP_REDUCE:
            raise PolicyError(f"group_reduce={self.group_reduce!r} is not supported: use one of {', '.join(GROUP_REDUCE)}")
        check_int("dense_layers", self.dense_layers, minimum=0)

    @property
    def spec(self) -> quest.QuestSpec:
        return quest.QuestSpec(self.page, self.budget, self.group_reduce)

    @property
    def label(self) -> str:
        extra = "".join(f" {k}{v}" for k, v, default in (("p", self.page, 16), ("d", self.dense_layers, 2))
                        if v != default)
        extra += "" if self.group_reduce == "max" else f" {self.group_reduce}"
        return self.chunk_label(f"quest {self.budget}{extra}")

    def check(self, model) -> None:
        shape = model_shape(model)
        shape.check_full_attention("quest reads")
        if self.dense_layers > shape.num_layers:
            raise PolicyError(f"dense_layers={self.dense_layers} exceeds {shape.name}'s {shape.num_layers} layers")
        why = kernel_problem(shape.head_dim, self.page)
        if why and on_cuda(model):
            raise PolicyError(f"quest's CUDA kernel cannot read {shape.name}: {why}")

    def prepare(self, model) -> None:
        attention.install(hf_model(model))

    def make_cache(self, model):
        self.prepare(model)
        return quest_cache(model_shape(model).num_layers, self.spec, self.dense_layers)

    def fast_storage(self):
        return FullPolicy(), quest.QuestRead(self.spec, self.dense_layers)
