"""A discrete-event model of Tandem's RL pipeline, for planning runs before they use devices.

``simulate(config, costs) -> Result``: the steady-state samples/s, step time, where the step's time
goes, mean staleness and the bottleneck of one configuration (:class:`Config`: the runtime's modes
and knobs) on one set of measured or derived costs (:class:`Costs`). ``Config.from_spec`` maps a
runtime spec and names the fields whose effect is not modelled; :mod:`capacity.hardware` turns
published hardware figures into costs. Standard library, numpy and simpy only: no Django, no torch.
See docs/capacity.md.
"""

from capacity.checks import InputError
from capacity.config import Config
from capacity.costs import Costs, Link
from capacity.lengths import LengthDistribution, fixed_lengths
from capacity.model import ModelError, simulate
from capacity.result import Bottleneck, Result
from capacity.spec_mapping import NotModelled, SpecMapping

__all__ = [
    "Bottleneck",
    "Config",
    "Costs",
    "InputError",
    "LengthDistribution",
    "Link",
    "ModelError",
    "NotModelled",
    "Result",
    "SpecMapping",
    "fixed_lengths",
    "simulate",
]
