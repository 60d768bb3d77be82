"""HLO tooling: lowering, parsing, the operator graph, liveness and compiled-module analysis
(collectives, memory, kernels)."""

from hlo_tools.compiled import Collective, MemoryStats, collectives, device_memory, summarize
from hlo_tools.graph import Node, OpGraph, Phase, UnsupportedOpError, build_graph, graph_from_text
from hlo_tools.hlo_text import HloParseError, parse_module
from hlo_tools.kernels import Kernel, kernels
from hlo_tools.layers import LayerReport, find_layers, layer_report, path_components
from hlo_tools.liveness import Liveness, liveness
from hlo_tools.lower import argument_paths, lower_to_graph, lower_to_hlo

__all__ = [
    "Collective", "MemoryStats", "collectives", "device_memory", "summarize",
    "Node", "OpGraph", "Phase", "UnsupportedOpError", "build_graph", "graph_from_text",
    "HloParseError", "parse_module", "Kernel", "kernels", "LayerReport", "find_layers",
    "layer_report", "path_components", "Liveness", "liveness", "argument_paths",
    "lower_to_graph", "lower_to_hlo",
]
