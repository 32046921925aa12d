"""Tensor/data-parallel building blocks (layers, gradient reduction, sharded optimizer)."""
