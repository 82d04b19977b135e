"""Layer placement: each layer of a functional model on a device, by a map or a balancer."""
