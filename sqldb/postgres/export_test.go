package postgres

// WrapConn is the Driver.WrapConn of PostgreSQL, for the tests that open pgx's driver
// themselves.
var WrapConn = wrapConn
