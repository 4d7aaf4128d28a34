"""Training pipelines of the assets semcomm ships (run from the repository root).

    python -m tools.train.semantic_cross      # the cross-encoder verifier adapter
    python -m tools.train.semantic_verifier   # the lexical verifier weights
    python -m tools.train.semantic_intent --fit 30   # the intent check of cluster hits
    python -m tools.train.router_real --ship  # the model router of the embedded default
    python -m tools.train.routing_calibrate   # a cost-model calibration for the router
"""
