"""What a model's pieces cost: its call graph, measured call and block times, and their cache."""
