"""The launcher and its machinery: worker processes, hosts, remote shells and elastic
membership. Nothing here imports TensorFlow."""
