"""A method that is a storage and nothing else (a quantized layout, a sparse read, a new format):
its policy is made from the storage class, so a storage family needs no policy module of its own.

    POLICIES.update(storage_policies(SomeStorage, OtherStorage))   # kvlab.policies

The policy's parameters are the storage's dataclass fields (with their defaults and help), so
``kvlab policies``, sweep params and records see them as any method's; its label, bits, checks and
caches are the storage's.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields, make_dataclass
from typing import Any, ClassVar

from kvlab.policies.base import Policy, hf_model, model_shape, on_cuda
from kvlab.storage import attention


@dataclass(frozen=True)
class StoredPolicy(Policy):
    """Base of a storage's policy: the fields are the storage's, ``storage()`` builds it from them."""

    storage_class: ClassVar[type]

    def __post_init__(self):
        super().__post_init__()
        params = {f.name: getattr(self, f.name) for f in fields(self.storage_class)}
        object.__setattr__(self, "_storage", self.storage_class(**params))

    def storage(self):
        return self._storage

    def params(self) -> dict[str, Any]:
        """The policy's params, less a field marked ``omit_default`` that holds its default (a parameter
        added to a storage leaves the run ids of the runs before it unchanged)."""
        out = super().params()
        for f in fields(self.storage_class):
            if f.metadata.get("omit_default") and getattr(self, f.name) == f.default:
                del out[f.name]
        return out

    @property
    def bits(self) -> int | None:
        return self._storage.bits

    @property
    def label(self) -> str:
        return self.chunk_label(self._storage.label)

    def check(self, model) -> None:
        self._storage.check(model_shape(model), on_cuda(model))

    def stores_keys_per_token(self) -> bool:
        return self._storage.keys_per_token

    def prepare(self, model) -> None:
        if self._storage.attends_own_queries:  # its layers read a step's queries themselves
            attention.install(hf_model(model))

    def make_cache(self, model):
        self.prepare(model)
        return self._storage.make_cache(model_shape(model).num_layers)


def storage_policy(storage_class: type) -> type[Policy]:
    """The policy class of a storage class (``name``, ``summary``, dataclass fields of parameters,
    ``bits``, ``label``, ``attends_own_queries``, ``check(shape, cuda)``, ``make_cache(num_layers)``)."""
    own = []
    for f in fields(storage_class):
        default: Any = f.default if f.default is not MISSING else None
        own.append((f.name, f.type, field(default=default, metadata=f.metadata)))
    name = storage_class.__name__.removesuffix("Storage") + "Policy"
    return make_dataclass(name, own, bases=(StoredPolicy,), frozen=True,
                          namespace={"name": storage_class.name, "summary": storage_class.summary,
                                     "storage_class": storage_class, "__module__": __name__})


def storage_policies(*storage_classes: type) -> dict[str, type[Policy]]:
    """``{name: policy class}`` for :data:`kvlab.policies.POLICIES`."""
    return {cls.name: storage_policy(cls) for cls in storage_classes}
