"""memfit.training: ``memfit train`` on Accelerate (setup builders, the loop, checkpoints, OOM fallback).

Named ``training`` (not ``train``) so that it never shadows the public function ``memfit.train``.
"""
