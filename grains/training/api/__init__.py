"""What users and other packages see of training: the job spec, the wire types, the published
records (torch-free: the dashboard reads them) and the callbacks protocol."""
