"""Drafter training: data generation by the target, the DFlash training loop, evaluation."""
