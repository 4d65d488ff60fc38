"""Storage: one place that turns a URI (local path, s3://, gs://, ...) into an fsspec filesystem + path.

Object stores are reached through fsspec (s3fs for s3://). Credentials and endpoints come from the usual
environment (AWS_* variables, including AWS_ENDPOINT_URL for S3-compatible stores such as MinIO or moto).
"""

from batchrl.storage.fs import (
    StorageError,
    download_dir,
    expand_input_files,
    file_identities,
    is_local,
    is_transient_storage_error,
    join,
    local_copy,
    open_parquet,
    parquet_from_bytes,
    read_parquet,
    resolve,
    sha256_of,
    upload_file,
    write_bytes_atomic,
    write_parquet_atomic,
)
from batchrl.storage.layout import RunLayout

__all__ = [
    "RunLayout",
    "StorageError",
    "download_dir",
    "expand_input_files",
    "file_identities",
    "is_transient_storage_error",
    "is_local",
    "local_copy",
    "open_parquet",
    "parquet_from_bytes",
    "upload_file",
    "join",
    "read_parquet",
    "resolve",
    "sha256_of",
    "write_bytes_atomic",
    "write_parquet_atomic",
]
