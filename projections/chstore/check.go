package chstore

import (
	"context"
	"time"
)

// What `ledger doctor` reads of the server and the database: none of it
// creates or changes anything (Open only pings).

// ServerVersion is the server's version().
func (s *Store) ServerVersion(ctx context.Context) (string, error) {
	var v string
	if err := s.conn.QueryRow(ctx, "SELECT version()").Scan(&v); err != nil {
		return "", s.wrap("read version", err)
	}
	return v, nil
}

// Now is the server's now(). It is a DateTime, so whole seconds: a
// caller measuring clock skew must allow for that.
func (s *Store) Now(ctx context.Context) (time.Time, error) {
	var t time.Time
	if err := s.conn.QueryRow(ctx, "SELECT now()").Scan(&t); err != nil {
		return time.Time{}, s.wrap("read now()", err)
	}
	return t, nil
}

// MissingTables lists the tables Migrate creates (the projection's and
// schema_migrations) that the database lacks, schema_migrations first;
// all of them when the database does not exist.
func (s *Store) MissingTables(ctx context.Context) ([]string, error) {
	have, err := s.tables(ctx)
	if err != nil {
		return nil, err
	}
	var missing []string
	for _, n := range append([]string{"schema_migrations"}, tableNames()...) {
		if !have[n] {
			missing = append(missing, n)
		}
	}
	return missing, nil
}

// tableNames are the projection's tables, schema_migrations aside: those
// Write fills, its positions last.
func tableNames() []string {
	out := make([]string, 0, len(tables)+1)
	for _, t := range tables {
		out = append(out, t.name)
	}
	return append(out, positionsTable.name)
}
