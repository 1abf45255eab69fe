"""Training: the recipe (mpc teacher, behaviour cloning, DAgger, fine-tuning, selection), PPO
from scratch, several seeds, ensembles of students and the hyperparameter search."""
