"""The job spec: typed, validated, every error names its field."""
from elasticrl.spec.load import SpecError, describe, dump_spec, load_spec, spec_to_dict
from elasticrl.spec.schema import JobSpec

__all__ = ["JobSpec", "SpecError", "describe", "dump_spec", "load_spec", "spec_to_dict"]
