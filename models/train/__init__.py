"""Training: the step every model trains with (`step`), fine-tuning a loaded model
(`finetune`), training the small models from scratch (`scratch`) on their tasks
(`tasks`), and the run's state on disk (`state`)."""
