"""How the model is split over processes: tensor, pipeline and expert parallelism on torch.distributed."""
