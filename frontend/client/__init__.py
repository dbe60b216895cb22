"""Client-side code the server never imports: the trainer's client and a launcher for tests and scripts."""
