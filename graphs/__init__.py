"""Region discovery, capture helpers, graph hashing and readable dumps."""

from omni_compile.graphs.hashing import graph_hash, input_signature
from omni_compile.graphs.regions import Region, find_regions, structure_signature

__all__ = ["Region", "find_regions", "structure_signature", "graph_hash", "input_signature"]
