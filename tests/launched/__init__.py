"""Scripts that the tests start under the frameworks' real launchers (torchrun, accelerate
launch, Lightning's own process launcher), as a user starts a training script."""
