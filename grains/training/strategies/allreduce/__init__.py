"""All-reduce training (mode ``allreduce``): trainer grains in a torch.distributed group that meets
on the cluster's Redis, formed and re-formed by the driver."""
