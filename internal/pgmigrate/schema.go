package pgmigrate

import (
	"context"
	"fmt"
	"sync/atomic"

	"github.com/jackc/pgx/v5"

	"github.com/idemq/idemq/consumer"
)

// Queryer runs a query returning one row: a pool, a connection or a
// transaction.
type Queryer interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Schema is the schema of a store's table: the Config's, or, when the
// Config names none, the connection's current_schema() (the first schema
// of its search_path that exists, so a search_path set in the URL or on
// the role is honoured), learned once. It is the default of the three
// stores, processed, outbox and httpidem. The zero value has no Config
// schema; a Schema must not be copied once used.
type Schema struct {
	p atomic.Pointer[string]
}

// NewSchema returns the schema of a Config naming schema, which has passed
// ValidIdent; "" for the connection's current_schema().
func NewSchema(schema string) *Schema {
	s := &Schema{}
	if schema != "" {
		s.p.Store(&schema)
	}
	return s
}

// Get returns the schema, or "" while it is still to be learned.
func (s *Schema) Get() string {
	if p := s.p.Load(); p != nil {
		return *p
	}
	return ""
}

// Resolve returns the schema, asking db for its current_schema() the
// first time when the Config named none; a failed lookup is asked again on
// the next call. pkg and table name the store in errors.
func (s *Schema) Resolve(ctx context.Context, db Queryer, pkg, table string) (string, error) {
	if p := s.p.Load(); p != nil {
		return *p, nil
	}
	var schema *string
	if err := db.QueryRow(ctx, `SELECT current_schema()`).Scan(&schema); err != nil {
		return "", fmt.Errorf("%s: %s: read the schema from search_path: %w", pkg, table, err)
	}
	if schema == nil {
		return "", &consumer.ConfigError{Field: "Schema", Reason: "empty, and the connection's search_path names no existing schema: create one, fix search_path, or set Config.Schema"}
	}
	if err := ValidIdent("Schema", *schema); err != nil {
		return "", fmt.Errorf("%s: the search_path's schema: %w", pkg, err)
	}
	s.p.Store(schema)
	return *schema, nil
}

// Qualified returns "schema.table", unquoted, for messages; the schema is
// "(search_path)" while it is still to be learned.
func (s *Schema) Qualified(table string) string {
	if schema := s.Get(); schema != "" {
		return schema + "." + table
	}
	return "(search_path)." + table
}

// Table is a store's table whose schema may be learned on first use, and
// the store's SQL for it, built once the schema is known.
type Table[T any] struct {
	schema     *Schema
	pkg, name  string
	indexes    map[string]string
	build      func(qTable string) *T
	statements atomic.Pointer[T]
}

// NewTable returns the table name in schema ("" for the connection's
// current_schema()) of the store pkg, whose SQL build makes from the
// quoted, qualified table, and whose migrations expand the placeholders of
// indexes (see Target.Indexes).
func NewTable[T any](pkg, schema, name string, indexes map[string]string, build func(qTable string) *T) *Table[T] {
	return &Table[T]{schema: NewSchema(schema), pkg: pkg, name: name, indexes: indexes, build: build}
}

// Statements returns the store's SQL, resolving the schema through q (the
// store's handle, or the caller's transaction) the first time.
func (t *Table[T]) Statements(ctx context.Context, q Queryer) (*T, error) {
	if st := t.statements.Load(); st != nil {
		return st, nil
	}
	schema, err := t.schema.Resolve(ctx, q, t.pkg, t.name)
	if err != nil {
		return nil, err
	}
	st := t.build(pgx.Identifier{schema, t.name}.Sanitize())
	t.statements.Store(st)
	return st, nil
}

// Target returns the table the migrations apply to, resolving the schema
// through q.
func (t *Table[T]) Target(ctx context.Context, q Queryer) (Target, error) {
	schema, err := t.schema.Resolve(ctx, q, t.pkg, t.name)
	if err != nil {
		return Target{}, err
	}
	return Target{Schema: schema, Table: t.name, Indexes: t.indexes}, nil
}

// Schema returns the schema, or "" while it is still to be learned.
func (t *Table[T]) Schema() string { return t.schema.Get() }

// String returns "schema.table", unquoted, for messages.
func (t *Table[T]) String() string { return t.schema.Qualified(t.name) }
