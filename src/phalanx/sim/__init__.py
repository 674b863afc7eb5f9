"""The simulator: virtual nodes on real controllers and a real store (docs/sim.md)."""
