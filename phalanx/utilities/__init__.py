"""Small helpers shared across phalanx, and the helpers Lightning users import from its ``utilities``."""

from __future__ import annotations

import importlib as _importlib
from typing import Any

from phalanx.utilities.lightning_names import NotOffered, missing_name_error
from phalanx.utilities.rank_zero import rank_zero_debug, rank_zero_info, rank_zero_only, rank_zero_warn

# Lightning's names that live in modules importing torch: loaded on first use, so that importing one rank-zero helper
# stays cheap. name -> (module, name there)
_LAZY = {
    "AttributeDict": ("phalanx.utilities.hparams", "AttributeDict"),
    "GradClipAlgorithmType": ("phalanx.utilities.enums", "GradClipAlgorithmType"),
    "grad_norm": ("phalanx.utilities.grads", "grad_norm"),
    "measure_flops": ("phalanx.utilities.throughput", "measure_flops"),
    "move_data_to_device": ("phalanx.utilities.apply", "move_to_device"),
}

#: Lightning's utilities that phalanx does not have, with what to use instead.
NOT_OFFERED = {
    "CombinedLoader": NotOffered(
        "a list of dataloaders for validate, test and predict (run one after another), and for training one DataLoader"
        " over a Dataset that combines the others"
    ),
    "LightningEnum": NotOffered("a str-valued enum.Enum (class Mode(str, Enum))"),
    "disable_possible_user_warnings": NotOffered("warnings.filterwarnings('ignore', module='phalanx')"),
    "find_shared_parameters": NotOffered("module.named_parameters(remove_duplicate=False), which lists tied ones"),
    "set_shared_parameters": NotOffered("assigning the same nn.Parameter to both modules after the model is set up"),
    "is_picklable": NotOffered("pickle.dumps(obj) inside try/except"),
    "is_shared_filesystem": NotOffered("a file written on global rank 0 and looked for on the others after a barrier"),
    "rank_zero_deprecation": NotOffered("rank_zero_warn(message, category=DeprecationWarning)"),
    "suggested_max_num_workers": NotOffered("len(os.sched_getaffinity(0)) // devices - 1 as DataLoader(num_workers=)"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attribute = _LAZY[name]
        value = getattr(_importlib.import_module(module), attribute)
        globals()[name] = value
        return value
    raise missing_name_error(__name__, name, NOT_OFFERED)


__all__ = [
    "AttributeDict",
    "GradClipAlgorithmType",
    "grad_norm",
    "measure_flops",
    "move_data_to_device",
    "rank_zero_debug",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
]
