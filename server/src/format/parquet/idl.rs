//! The structs of parquet.thrift that arrow-rs 60 reads from a footer or a page header, field by
//! field, with the types it reads them as: what [`super::thrift::Reader::walk`] holds a footer or
//! header to before arrow-rs sees it.
//!
//! A field arrow-rs reads is listed here with its type; a field it skips (fields added to the
//! format later) may be left out, as the walk then skips it as arrow-rs does. A field listed that
//! arrow-rs skips only makes the walk stricter than arrow-rs, never laxer; a field arrow-rs reads
//! that is missing here lets the two read a hostile footer differently, which is what this module
//! exists to prevent.
//!
//! So an upgrade of arrow-rs compares this module with every reader it has for these structs:
//! - `file/metadata/thrift/mod.rs`: the `thrift_struct!` ones and the hand-written ones
//!   (`ColumnMetaData`, `ColumnChunk`, `RowGroup`, `FileMetaData`, the page headers read without
//!   statistics);
//! - `basic.rs`: the unions and the `LogicalType` variants;
//! - `parquet_thrift.rs`: the scalar reads (an `i8` is one byte);
//! - should the `encryption` feature ever be turned on, `file/metadata/thrift/encryption.rs` and
//!   `file/column_crypto_metadata.rs` (with it off, arrow-rs skips the fields listed here for them).
//!
//! The workspace pins `parquet` exactly so that an upgrade is never a side effect of `cargo update`.

use super::thrift::Ty::{self, Binary, Bool, Byte, Double, I16, I32, I64, List, Struct};

/// A struct none of whose fields arrow-rs reads (a union's empty variants, `IndexPageHeader`).
const EMPTY: &[(i16, Ty)] = &[];

const STATISTICS: &[(i16, Ty)] = &[
    (1, Binary), // max
    (2, Binary), // min
    (3, I64),    // null_count
    (4, I64),    // distinct_count
    (5, Binary), // max_value
    (6, Binary), // min_value
    (7, Bool),   // is_max_value_exact
    (8, Bool),   // is_min_value_exact
    (9, I64),    // nan_count
];

const KEY_VALUE: &[(i16, Ty)] = &[(1, Binary), (2, Binary)];

const PAGE_ENCODING_STATS: &[(i16, Ty)] = &[(1, I32), (2, I32), (3, I32)];

const SIZE_STATISTICS: &[(i16, Ty)] = &[(1, I64), (2, List(&I64)), (3, List(&I64))];

const BOUNDING_BOX: &[(i16, Ty)] =
    &[(1, Double), (2, Double), (3, Double), (4, Double), (5, Double), (6, Double), (7, Double), (8, Double)];

const GEOSPATIAL_STATISTICS: &[(i16, Ty)] = &[(1, Struct(BOUNDING_BOX)), (2, List(&I32))];

const COLUMN_META_DATA: &[(i16, Ty)] = &[
    (1, I32),                                 // type
    (2, List(&I32)),                          // encodings
    (3, List(&Binary)),                       // path_in_schema
    (4, I32),                                 // codec
    (5, I64),                                 // num_values
    (6, I64),                                 // total_uncompressed_size
    (7, I64),                                 // total_compressed_size
    (8, List(&Struct(KEY_VALUE))),            // key_value_metadata
    (9, I64),                                 // data_page_offset
    (10, I64),                                // index_page_offset
    (11, I64),                                // dictionary_page_offset
    (12, Struct(STATISTICS)),                 // statistics
    (13, List(&Struct(PAGE_ENCODING_STATS))), // encoding_stats
    (14, I64),                                // bloom_filter_offset
    (15, I32),                                // bloom_filter_length
    (16, Struct(SIZE_STATISTICS)),            // size_statistics
    (17, Struct(GEOSPATIAL_STATISTICS)),      // geospatial_statistics
];

const COLUMN_CHUNK: &[(i16, Ty)] = &[
    (1, Binary),                          // file_path
    (2, I64),                             // file_offset
    (3, Struct(COLUMN_META_DATA)),        // meta_data
    (4, I64),                             // offset_index_offset
    (5, I32),                             // offset_index_length
    (6, I64),                             // column_index_offset
    (7, I32),                             // column_index_length
    (8, Struct(COLUMN_CRYPTO_META_DATA)), // crypto_metadata
    (9, Binary),                          // encrypted_column_metadata
];

const SORTING_COLUMN: &[(i16, Ty)] = &[(1, I32), (2, Bool), (3, Bool)];

const ROW_GROUP: &[(i16, Ty)] = &[
    (1, List(&Struct(COLUMN_CHUNK))),   // columns
    (2, I64),                           // total_byte_size
    (3, I64),                           // num_rows
    (4, List(&Struct(SORTING_COLUMN))), // sorting_columns
    (5, I64),                           // file_offset
    (6, I64),                           // total_compressed_size
    (7, I16),                           // ordinal
];

/// `TimeUnit`: a union of empty structs.
const TIME_UNIT: &[(i16, Ty)] = &[(1, Struct(EMPTY)), (2, Struct(EMPTY)), (3, Struct(EMPTY))];

/// `TimeType` and `TimestampType`.
const TIME: &[(i16, Ty)] = &[(1, Bool), (2, Struct(TIME_UNIT))];

const LOGICAL_TYPE: &[(i16, Ty)] = &[
    (1, Struct(EMPTY)),                     // STRING
    (2, Struct(EMPTY)),                     // MAP
    (3, Struct(EMPTY)),                     // LIST
    (4, Struct(EMPTY)),                     // ENUM
    (5, Struct(&[(1, I32), (2, I32)])),     // DECIMAL
    (6, Struct(EMPTY)),                     // DATE
    (7, Struct(TIME)),                      // TIME
    (8, Struct(TIME)),                      // TIMESTAMP
    (10, Struct(&[(1, Byte), (2, Bool)])),  // INTEGER
    (11, Struct(EMPTY)),                    // UNKNOWN
    (12, Struct(EMPTY)),                    // JSON
    (13, Struct(EMPTY)),                    // BSON
    (14, Struct(EMPTY)),                    // UUID
    (15, Struct(EMPTY)),                    // FLOAT16
    (16, Struct(&[(1, Byte)])),             // VARIANT
    (17, Struct(&[(1, Binary)])),           // GEOMETRY
    (18, Struct(&[(1, Binary), (2, I32)])), // GEOGRAPHY
    (19, Struct(EMPTY)),                    // FILE
];

const SCHEMA_ELEMENT: &[(i16, Ty)] = &[
    (1, I32),                   // type
    (2, I32),                   // type_length
    (3, I32),                   // repetition_type
    (4, Binary),                // name
    (5, I32),                   // num_children
    (6, I32),                   // converted_type
    (7, I32),                   // scale
    (8, I32),                   // precision
    (9, I32),                   // field_id
    (10, Struct(LOGICAL_TYPE)), // logicalType
];

/// `ColumnOrder`: a union of empty structs.
const COLUMN_ORDER: &[(i16, Ty)] = &[(1, Struct(EMPTY)), (2, Struct(EMPTY)), (3, Struct(EMPTY))];

/// `AesGcmV1` and `AesGcmCtrV1`.
const AES_GCM: &[(i16, Ty)] = &[(1, Binary), (2, Binary), (3, Bool)];

/// `EncryptionAlgorithm`: a union.
const ENCRYPTION_ALGORITHM: &[(i16, Ty)] = &[(1, Struct(AES_GCM)), (2, Struct(AES_GCM))];

/// `ColumnCryptoMetaData`: a union of `EncryptionWithFooterKey` and `EncryptionWithColumnKey`.
const COLUMN_CRYPTO_META_DATA: &[(i16, Ty)] = &[(1, Struct(EMPTY)), (2, Struct(&[(1, List(&Binary)), (2, Binary)]))];

pub(super) const FILE_META_DATA: &[(i16, Ty)] = &[
    (1, I32),                           // version
    (2, List(&Struct(SCHEMA_ELEMENT))), // schema
    (3, I64),                           // num_rows
    (4, List(&Struct(ROW_GROUP))),      // row_groups
    (5, List(&Struct(KEY_VALUE))),      // key_value_metadata
    (6, Binary),                        // created_by
    (7, List(&Struct(COLUMN_ORDER))),   // column_orders
    (8, Struct(ENCRYPTION_ALGORITHM)),  // encryption_algorithm
    (9, Binary),                        // footer_signing_key_metadata
];

const DATA_PAGE_HEADER: &[(i16, Ty)] = &[(1, I32), (2, I32), (3, I32), (4, I32), (5, Struct(STATISTICS))];

const DICTIONARY_PAGE_HEADER: &[(i16, Ty)] = &[(1, I32), (2, I32), (3, Bool)];

const DATA_PAGE_HEADER_V2: &[(i16, Ty)] =
    &[(1, I32), (2, I32), (3, I32), (4, I32), (5, I32), (6, I32), (7, Bool), (8, Struct(STATISTICS))];

pub(super) const PAGE_HEADER: &[(i16, Ty)] = &[
    (1, I32),                            // type
    (2, I32),                            // uncompressed_page_size
    (3, I32),                            // compressed_page_size
    (4, I32),                            // crc
    (5, Struct(DATA_PAGE_HEADER)),       // data_page_header
    (6, Struct(EMPTY)),                  // index_page_header
    (7, Struct(DICTIONARY_PAGE_HEADER)), // dictionary_page_header
    (8, Struct(DATA_PAGE_HEADER_V2)),    // data_page_header_v2
];
