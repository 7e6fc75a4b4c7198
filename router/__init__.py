"""Prefix index and routing policy. No torch here; ``router.protocol`` is the engines' contract."""
