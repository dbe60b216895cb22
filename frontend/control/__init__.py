"""Control routes for RL trainers: weight updates, sleep / wake-up, pause, across replicas."""
