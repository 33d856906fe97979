"""One request's path and its state: the flow, the span copy, the check layer, the donors
and the request's reuse record. Nothing here wraps an sglang class."""
