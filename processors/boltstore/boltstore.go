// Package boltstore is the embedded execution store (processors.Store) of
// `ledger dev`: one bbolt file in the data directory, pure Go, no server,
// durable across restarts.
//
// Each method is one bbolt read-write transaction (View for Expired,
// Unlogged, ByStatus and Get). bbolt runs one writer at a time, so every
// batch is serializable by construction and nothing ever needs a retry;
// the price is that writers queue, which is fine for one process on one
// machine and is why production uses processors/pgstore.
//
// Layout, in buckets:
//
//	records  key: uvarint(len(tenant_id)) tenant_id idempotency_key
//	         value: the record as JSON (diskRecord; JSON so the file can be
//	         inspected with bbolt's tools and fields can be added without a
//	         migration)
//	leases   key: lease_until (8 bytes, big-endian, order-preserving) record key
//	         value: empty; one entry per executing record, so Expired reads
//	         the oldest leases first without scanning every record
//	unlogged2 key: updated_at (8 bytes, as in leases) record key
//	         value: empty; one entry per record with LoggedSeq < Seq in
//	         any status but executing, so Unlogged reads the oldest first
//	         without scanning every record
//	status   key: uvarint(len(status)) status updated_at (as in leases)
//	         record key
//	         value: empty; one entry per record, so ByStatus reads one
//	         status, oldest update first, without scanning every record
//	tenant_status key: uvarint(len(tenant_id)) tenant_id, then the
//	         record's status entry without the tenant part of its record
//	         key (uvarint(len(status)) status updated_at idempotency_key)
//	         value: empty; one entry per record in a listed status
//	         (processors.ListedStatuses: those few calls reach, so a
//	         call's usual path writes none), so TenantByStatus reads
//	         one tenant's records in such a status, in ByStatus's order,
//	         without reading the other tenants' (another status is read
//	         through status, skipping them) (the record key is the
//	         entry's tenant part followed by its idempotency key; no
//	         longer than the status entry, so the record key's size limit
//	         holds for both)
//	journal  key: a journal entry's name (processors.Completion.Journal)
//	         value: the entry as JSON (diskJournal): when it was written
//	         and its calls; created by Open if missing, like rates
//	rates    key: a rate limiter bucket name (processors.RateLimiter)
//	         value: its GCRA theoretical arrival time, RFC 3339 text in UTC
//	         with microseconds; created by Open if missing, so files
//	         written before it existed need no format change
//	meta     "format": the layout version ("1"); Open refuses other values.
//	         "indexed_txid": the bbolt transaction id of the last write
//	         by this build's code (8 bytes, big-endian), then the layout
//	         of the indexes it keeps (indexLayout, one byte)
//
// leases, unlogged2, status and tenant_status are indexes derived from
// the records, kept in step by every write. Open rebuilds all of them from
// the records when one is missing or when the file's last write was not
// this code's (the transaction id after indexed_txid is not the one Open
// runs in): another build, older or newer, may have written records
// without maintaining them, as builds before the unlogged2, status and
// tenant_status indexes do. A file written before they existed therefore
// needs no format change, and going back and forth between builds costs a
// rebuild, not a stale index: builds that stamp the same transaction id
// but keep other indexes (those before tenant_status stamp 8 bytes, and
// read this build's 9 as no stamp) are told apart by indexLayout. Open
// also deletes the "unlogged" bucket of earlier builds (it held done
// records only); a build that uses it rebuilds it when it finds it
// missing.
//
// Data the file cannot hold as given (a string that is not valid UTF-8,
// which JSON would silently replace; a key over bbolt's size limit) and
// batches that no store may apply (processors.CheckAdmissions...) are
// refused with errors wrapping processors.ErrRejected.
//
// The store's clock is Config.Now (time.Now by default): leases are
// measured against it, as pgstore measures them against the database's
// now().
package boltstore

import (
	"bytes"
	"cmp"
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"time"
	"unicode/utf8"

	bolt "go.etcd.io/bbolt"
	berrors "go.etcd.io/bbolt/errors"

	"github.com/toolcall-ledger/ledger/ledger"
	"github.com/toolcall-ledger/ledger/processors"
)

var (
	bucketRecords  = []byte("records")
	bucketLeases   = []byte("leases")
	bucketUnlogged = []byte("unlogged2")
	bucketStatus   = []byte("status")
	// bucketTenantStatus is the status index keyed tenant first.
	bucketTenantStatus = []byte("tenant_status")
	bucketMeta         = []byte("meta")
	bucketRates        = []byte("rates")
	bucketJournal      = []byte("journal")
	metaFormat         = []byte("format")
	metaTxID           = []byte("indexed_txid")
	// bucketOldUnlogged is the unlogged index of earlier builds, done
	// records only; Open deletes it.
	bucketOldUnlogged = []byte("unlogged")
)

// indexBuckets are the indexes derived from the records.
var indexBuckets = [][]byte{bucketLeases, bucketUnlogged, bucketStatus, bucketTenantStatus}

// format is the layout version written into the meta bucket.
const format = "1"

// ErrFormat: the file was written with a layout this build does not read.
var ErrFormat = errors.New("unsupported execution store format")

// Config configures the store.
type Config struct {
	// Path is the database file, e.g. <data dir>/executions.db. Its
	// directory is created if missing. Required.
	Path string
	// Now is the store's clock, read once per batch, for leases and
	// timestamps. Default time.Now; tests inject a fake clock.
	Now func() time.Time
	// Logger receives lifecycle logs. Nil discards.
	Logger *slog.Logger
	// OpenTimeout bounds the wait for the file lock, held while another
	// process has the file open. Default 5s; Open fails after it.
	OpenTimeout time.Duration
}

func (c *Config) setDefaults() {
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.OpenTimeout == 0 {
		c.OpenTimeout = 5 * time.Second
	}
}

func (c *Config) validate() error {
	if c.Path == "" {
		return errors.New("boltstore: Path is required")
	}
	if c.OpenTimeout < 0 {
		return fmt.Errorf("boltstore: OpenTimeout %v is negative", c.OpenTimeout)
	}
	return nil
}

// Store is the bbolt execution store. It is safe for concurrent use.
type Store struct {
	db  *bolt.DB
	now func() time.Time
	log *slog.Logger
	// entryRead, when set (tests only), is called with every status
	// index entry a listing reads.
	entryRead func(k []byte)
}

var _ processors.Store = (*Store)(nil)

// Open opens (creating if needed) the store at cfg.Path.
func Open(cfg Config) (*Store, error) {
	cfg.setDefaults()
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(filepath.Dir(cfg.Path), 0o755); err != nil {
		return nil, fmt.Errorf("boltstore: create directory: %w", err)
	}
	db, err := bolt.Open(cfg.Path, 0o600, &bolt.Options{Timeout: cfg.OpenTimeout})
	if err != nil {
		return nil, fmt.Errorf("boltstore: open %s: %w", cfg.Path, err)
	}
	err = db.Update(func(tx *bolt.Tx) error {
		for _, b := range [][]byte{bucketRecords, bucketMeta, bucketRates, bucketJournal} {
			if _, err := tx.CreateBucketIfNotExists(b); err != nil {
				return err
			}
		}
		meta := tx.Bucket(bucketMeta)
		switch v := meta.Get(metaFormat); {
		case v == nil:
			if err := meta.Put(metaFormat, []byte(format)); err != nil {
				return err
			}
		case string(v) != format:
			return fmt.Errorf("%s has format %q, want %q: %w", cfg.Path, v, format, ErrFormat)
		}
		if err := tx.DeleteBucket(bucketOldUnlogged); err != nil && !errors.Is(err, berrors.ErrBucketNotFound) {
			return err
		}
		if why := indexesStale(tx); why != "" {
			n, err := rebuildIndexes(tx)
			if err != nil {
				return fmt.Errorf("rebuild the indexes: %w", err)
			}
			cfg.Logger.Info("execution store rebuilt its indexes", "path", cfg.Path, "reason", why, "records", n)
		}
		return stampTxID(tx)
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("boltstore: initialize: %w", err)
	}
	cfg.Logger.Info("execution store opened", "path", cfg.Path)
	return &Store{db: db, now: cfg.Now, log: cfg.Logger}, nil
}

// indexesStale says why the derived indexes cannot be trusted, or "" if
// they can: every one exists and the file's last write was this code's.
// tx must be the read-write transaction of Open.
func indexesStale(tx *bolt.Tx) string {
	for _, b := range indexBuckets {
		if tx.Bucket(b) == nil {
			return fmt.Sprintf("no %s index", b)
		}
	}
	v := tx.Bucket(bucketMeta).Get(metaTxID)
	switch {
	case len(v) == 8:
		return "indexes kept by a build of another layout"
	case len(v) != 9:
		return "no record of the last indexed write"
	case v[8] != indexLayout:
		return fmt.Sprintf("indexes of layout %d, not %d", v[8], indexLayout)
	}
	// A write transaction's id is the last committed one's plus one.
	if last := binary.BigEndian.Uint64(v); last+1 != uint64(tx.ID()) {
		return fmt.Sprintf("written since transaction %d by other code (now at %d)", last, tx.ID()-1)
	}
	return ""
}

// rebuildIndexes empties the derived indexes and fills them from the
// records; it returns how many records it indexed.
func rebuildIndexes(tx *bolt.Tx) (int, error) {
	x := &txn{records: tx.Bucket(bucketRecords)}
	for _, b := range indexBuckets {
		if err := tx.DeleteBucket(b); err != nil && !errors.Is(err, berrors.ErrBucketNotFound) {
			return 0, err
		}
		if _, err := tx.CreateBucket(b); err != nil {
			return 0, err
		}
	}
	x.leases, x.unlogged, x.status, x.tenantStatus = tx.Bucket(bucketLeases), tx.Bucket(bucketUnlogged), tx.Bucket(bucketStatus), tx.Bucket(bucketTenantStatus)
	n := 0
	err := x.records.ForEach(func(rk, v []byte) error {
		var d diskRecord
		if err := json.Unmarshal(v, &d); err != nil {
			return fmt.Errorf("decode record %x: %v", rk, err)
		}
		r := d.record()
		n++
		return x.index(nil, &r, rk)
	})
	return n, err
}

// indexLayout names what the derived indexes hold, in the stamp after the
// transaction id: a build that keeps them otherwise (another bucket, other
// entries in one) has another layout, so that Open rebuilds rather than
// trust indexes such a build kept in step by its own rules. Bump it with
// every change of what an index holds. 2: tenant_status, listed statuses
// only.
const indexLayout = 2

// stampTxID records tx as the last write of this code (see indexesStale).
// Every read-write transaction of the store calls it before committing.
func stampTxID(tx *bolt.Tx) error {
	return tx.Bucket(bucketMeta).Put(metaTxID, append(binary.BigEndian.AppendUint64(nil, uint64(tx.ID())), indexLayout))
}

// write runs fn in one read-write transaction and stamps it (stampTxID).
func (s *Store) write(fn func(tx *bolt.Tx) error) error {
	return s.db.Update(func(tx *bolt.Tx) error {
		if err := fn(tx); err != nil {
			return err
		}
		return stampTxID(tx)
	})
}

// Close closes the file. The store must not be used after.
func (s *Store) Close() error { return s.db.Close() }

// diskRecord is a Record as stored. Its JSON names are the file format:
// rename nothing without bumping format.
type diskRecord struct {
	TenantID       string `json:"tenant_id"`
	IdempotencyKey string `json:"idempotency_key"`
	CallID         string `json:"call_id"`
	ArgumentsHash  string `json:"arguments_hash"`
	UserID         string `json:"user_id,omitempty"`
	Tool           string `json:"tool"`
	ToolVersion    int    `json:"tool_version"`
	// Absent from the records of builds before tool digests: binds
	// nothing.
	ToolDigest string            `json:"tool_digest,omitempty"`
	Arguments  []byte            `json:"arguments,omitempty"`
	DeadlineAt time.Time         `json:"deadline_at,omitzero"`
	Status     processors.Status `json:"status"`
	Epoch      int64             `json:"epoch"`
	Attempt    int               `json:"attempt"`
	LeaseOwner string            `json:"lease_owner,omitempty"`
	LeaseUntil time.Time         `json:"lease_until,omitzero"`
	Result     []byte            `json:"result,omitempty"`
	Seq        int64             `json:"seq"`
	LoggedSeq  int64             `json:"logged_seq"`
	Outbox     []byte            `json:"outbox,omitempty"`
	CreatedAt  time.Time         `json:"created_at"`
	UpdatedAt  time.Time         `json:"updated_at"`
	// Absent from the records of builds before per-call credentials: they
	// read as none.
	JTI              string `json:"jti,omitempty"`
	CredentialFamily string `json:"credential_family,omitempty"`
	// Absent from the records of older builds, and of calls nothing
	// undid: zero.
	UndoMarks int64 `json:"undo_marks,omitempty"`
	// Absent from the records of older builds, and of calls no lease of
	// lapsed: none.
	LapsedFamilies []string `json:"lapsed_families,omitempty"`
	// Absent from the records of older builds, and of calls whose
	// lookups all answered: none.
	Unanswered *diskUnanswered `json:"unanswered,omitempty"`
}

// diskUnanswered is a processors.Unanswered as stored.
type diskUnanswered struct {
	Seq        int64     `json:"seq"`
	Since      time.Time `json:"since"`
	InProgress bool      `json:"in_progress,omitempty"`
}

func toDisk(r processors.Record) diskRecord {
	return diskRecord{
		TenantID: r.Key.TenantID, IdempotencyKey: r.Key.IdempotencyKey,
		CallID: r.CallID, ArgumentsHash: r.ArgumentsHash, UserID: r.UserID, Tool: r.Tool, ToolVersion: r.ToolVersion,
		ToolDigest: r.ToolDigest, Arguments: r.Arguments, DeadlineAt: r.DeadlineAt, Status: r.Status,
		Epoch: r.Epoch, Attempt: r.Attempt, LeaseOwner: r.LeaseOwner, LeaseUntil: r.LeaseUntil,
		Result: r.Result, Seq: r.Seq, LoggedSeq: r.LoggedSeq, Outbox: r.Outbox,
		CreatedAt: r.CreatedAt, UpdatedAt: r.UpdatedAt,
		JTI: r.Credential.JTI, CredentialFamily: r.Credential.Family,
		UndoMarks: r.UndoMarks, LapsedFamilies: r.LapsedFamilies,
		Unanswered: toDiskUnanswered(r.Unanswered),
	}
}

func toDiskUnanswered(n processors.Unanswered) *diskUnanswered {
	if n == (processors.Unanswered{}) {
		return nil
	}
	return &diskUnanswered{Seq: n.Seq, Since: n.Since, InProgress: n.InProgress}
}

func (d diskRecord) record() processors.Record {
	return processors.Record{
		Key:    ledger.CallKey{TenantID: d.TenantID, IdempotencyKey: d.IdempotencyKey},
		CallID: d.CallID, ArgumentsHash: d.ArgumentsHash, UserID: d.UserID, Tool: d.Tool, ToolVersion: d.ToolVersion,
		ToolDigest: d.ToolDigest, Arguments: d.Arguments, DeadlineAt: d.DeadlineAt, Status: d.Status,
		Epoch: d.Epoch, Attempt: d.Attempt, LeaseOwner: d.LeaseOwner, LeaseUntil: d.LeaseUntil,
		Result: d.Result, Seq: d.Seq, LoggedSeq: d.LoggedSeq, Outbox: d.Outbox,
		CreatedAt: d.CreatedAt, UpdatedAt: d.UpdatedAt,
		Credential:     processors.CallCredential{JTI: d.JTI, Family: d.CredentialFamily},
		UndoMarks:      d.UndoMarks,
		LapsedFamilies: d.LapsedFamilies,
		Unanswered:     d.Unanswered.note(),
	}
}

func (d *diskUnanswered) note() processors.Unanswered {
	if d == nil {
		return processors.Unanswered{}
	}
	return processors.Unanswered{Seq: d.Seq, Since: d.Since, InProgress: d.InProgress}
}

// recordKey is tenantPrefix(tenant) idempotency_key: unambiguous
// whatever bytes either part holds.
func recordKey(k ledger.CallKey) []byte {
	return append(tenantPrefix(k.TenantID, len(k.IdempotencyKey)), k.IdempotencyKey...)
}

// tenantPrefix is uvarint(len(tenant)) tenant: where tenant's records
// start in the records bucket and its entries in the tenant status index.
// The length prefix keeps one tenant's apart from those of a tenant it is
// a prefix of. spare is room to leave for what follows.
func tenantPrefix(tenant string, spare int) []byte {
	b := binary.AppendUvarint(make([]byte, 0, binary.MaxVarintLen64+len(tenant)+spare), uint64(len(tenant)))
	return append(b, tenant...)
}

// timeKey orders by t (a lease end, an update time), then record key.
// Flipping the sign bit makes big-endian byte order match int64 order.
func timeKey(t time.Time, rk []byte) []byte {
	b := binary.BigEndian.AppendUint64(make([]byte, 0, 8+len(rk)), uint64(t.UnixNano())^(1<<63))
	return append(b, rk...)
}

// seekPast moves c, over an index of timeKeys, to the first entry after
// the cursor's (past its own entry, if its record is still there), or to
// the first entry for the zero Cursor, and returns its key.
func seekPast(c *bolt.Cursor, after processors.Cursor) []byte {
	if after.IsZero() {
		k, _ := c.First()
		return k
	}
	from := timeKey(after.At, recordKey(after.Key))
	k, _ := c.Seek(from)
	if bytes.Equal(k, from) {
		k, _ = c.Next()
	}
	return k
}

// keyTime is the time a timeKey starts with.
func keyTime(k []byte) time.Time {
	return time.Unix(0, int64(binary.BigEndian.Uint64(k[:8])^(1<<63))).UTC()
}

// statusPrefix is where status's entries in the status index start. The
// length prefix keeps one status's entries apart from those of a status
// it is a prefix of.
func statusPrefix(st processors.Status) []byte {
	b := binary.AppendUvarint(make([]byte, 0, 1+len(st)), uint64(len(st)))
	return append(b, st...)
}

// statusKey orders by status, then update time, then record key.
func statusKey(st processors.Status, updated time.Time, rk []byte) []byte {
	return append(statusPrefix(st), timeKey(updated, rk)...)
}

// maxIndexPrefix is the longest prefix an index puts before a record key:
// a status index entry of the longest status.
func maxIndexPrefix() int {
	n := 0
	for _, st := range processors.Statuses {
		n = max(n, len(statusPrefix(st))+8)
	}
	return n
}

// inUnlogged reports whether r belongs in the unlogged index: what
// Unlogged returns, whatever its age.
func inUnlogged(r *processors.Record) bool {
	return r.Status != processors.StatusExecuting && r.LoggedSeq < r.Seq
}

// indexKeys are a record's entries in the derived indexes, nil for none.
type indexKeys struct{ lease, unlogged, status, tenantStatus []byte }

// keysOf returns r's index entries; nil r has none.
func keysOf(r *processors.Record, rk []byte) indexKeys {
	if r == nil {
		return indexKeys{}
	}
	var k indexKeys
	if r.Status == processors.StatusExecuting {
		k.lease = timeKey(r.LeaseUntil, rk)
	}
	if inUnlogged(r) {
		k.unlogged = timeKey(r.UpdatedAt, rk)
	}
	k.status = statusKey(r.Status, r.UpdatedAt, rk)
	if r.Status.Listed() {
		// rk less its tenant part, which the tenant prefix holds. Only
		// the listed statuses: a call's path through the others pays
		// for no entry here.
		k.tenantStatus = append(tenantPrefix(r.Key.TenantID, 0), statusKey(r.Status, r.UpdatedAt, []byte(r.Key.IdempotencyKey))...)
	}
	return k
}

// txn is one batch's view of the buckets.
type txn struct {
	records, leases, unlogged, status, tenantStatus, journal, rates *bolt.Bucket
	now                                                             time.Time
}

func (x *txn) get(k ledger.CallKey) (processors.Record, bool, error) {
	v := x.records.Get(recordKey(k))
	if v == nil {
		return processors.Record{}, false, nil
	}
	var d diskRecord
	if err := json.Unmarshal(v, &d); err != nil {
		return processors.Record{}, false, fmt.Errorf("decode record %v: %v", k, err)
	}
	return d.record(), true, nil
}

// index moves the index entries of the record at rk from what prev (nil:
// a new record) had to what r has. Every write of a record goes through
// it (by way of put), so the indexes follow every path: Admit, Claim,
// Complete, Release, MarkLogged, Move.
func (x *txn) index(prev, r *processors.Record, rk []byte) error {
	from, to := keysOf(prev, rk), keysOf(r, rk)
	for _, ix := range []struct {
		b        *bolt.Bucket
		from, to []byte
	}{
		{x.leases, from.lease, to.lease},
		{x.unlogged, from.unlogged, to.unlogged},
		{x.status, from.status, to.status},
		{x.tenantStatus, from.tenantStatus, to.tenantStatus},
	} {
		if bytes.Equal(ix.from, ix.to) {
			continue
		}
		if ix.from != nil {
			if err := ix.b.Delete(ix.from); err != nil {
				return err
			}
		}
		if ix.to != nil {
			if err := ix.b.Put(ix.to, nil); err != nil {
				return err
			}
		}
	}
	return nil
}

// put writes r, keeping the indexes in step with prev (the record as it
// was, or nil for a new one).
func (x *txn) put(prev *processors.Record, r processors.Record) error {
	rk := recordKey(r.Key)
	if err := x.index(prev, &r, rk); err != nil {
		return err
	}
	v, err := json.Marshal(toDisk(r))
	if err != nil {
		return fmt.Errorf("encode record %v: %v", r.Key, err)
	}
	return x.records.Put(rk, v)
}

// update runs fn in one read-write transaction, with one clock reading.
func (s *Store) update(ctx context.Context, op string, fn func(x *txn) error) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("boltstore %s: %w", op, err)
	}
	err := s.write(func(tx *bolt.Tx) error {
		return fn(&txn{
			records: tx.Bucket(bucketRecords), leases: tx.Bucket(bucketLeases),
			unlogged: tx.Bucket(bucketUnlogged), status: tx.Bucket(bucketStatus), tenantStatus: tx.Bucket(bucketTenantStatus),
			journal: tx.Bucket(bucketJournal), rates: tx.Bucket(bucketRates), now: s.now().UTC(),
		})
	})
	if errors.Is(err, berrors.ErrKeyTooLarge) || errors.Is(err, berrors.ErrValueTooLarge) {
		// Checked up front for keys (checkHoldable); a value this large
		// (2 GiB) is the data's problem too.
		return fmt.Errorf("boltstore %s: %w: %w", op, processors.ErrRejected, err)
	}
	if err != nil {
		return fmt.Errorf("boltstore %s: %w", op, err)
	}
	return nil
}

// checkString refuses a string JSON cannot hold as given: encoding/json
// replaces invalid UTF-8 with U+FFFD, so the record read back would differ
// from the one written, and its key from its bucket key.
func checkString(what, v string) error {
	if !utf8.ValidString(v) {
		return fmt.Errorf("%s %q is not valid UTF-8: %w", what, v, processors.ErrRejected)
	}
	return nil
}

// checkHoldable refuses admissions the file cannot hold as given: strings
// that are not valid UTF-8 (see checkString) and keys too long for bbolt
// once an index prefixes them (maxIndexPrefix).
func checkHoldable(as []processors.Admission) error {
	for i, a := range as {
		for _, f := range []struct{ what, v string }{
			{"tenant_id", a.Key.TenantID}, {"idempotency_key", a.Key.IdempotencyKey},
			{"call_id", a.CallID}, {"arguments_hash", a.ArgumentsHash}, {"user_id", a.UserID}, {"tool", a.Tool},
		} {
			if err := checkString(f.what, f.v); err != nil {
				return fmt.Errorf("admission %d: %w", i, err)
			}
		}
		if n := maxIndexPrefix() + len(recordKey(a.Key)); n > bolt.MaxKeySize {
			return fmt.Errorf("admission %d: key of %d bytes over bbolt's %d: %w", i, n, bolt.MaxKeySize, processors.ErrRejected)
		}
	}
	return nil
}

// Admit implements processors.Store.
func (s *Store) Admit(ctx context.Context, as []processors.Admission) ([]processors.AdmitResult, error) {
	if err := processors.CheckAdmissions(as); err != nil {
		return nil, fmt.Errorf("boltstore admit: %w: %w", processors.ErrRejected, err)
	}
	if err := checkHoldable(as); err != nil {
		return nil, fmt.Errorf("boltstore admit: %w", err)
	}
	if len(as) == 0 {
		return []processors.AdmitResult{}, nil
	}
	out := make([]processors.AdmitResult, len(as))
	err := s.update(ctx, "admit", func(x *txn) error {
		// A key whose first admission in the batch was refused: its
		// later copies are refused alike, not charged again.
		var limited map[ledger.CallKey][]processors.RateResult
		for i, a := range as {
			if err := ctx.Err(); err != nil {
				return err
			}
			if res, ok := limited[a.Key]; ok {
				out[i] = processors.AdmitResult{Outcome: processors.Limited, Rates: res}
				continue
			}
			cur, ok, err := x.get(a.Key)
			if err != nil {
				return err
			}
			if ok {
				out[i] = processors.AdmitResult{Outcome: a.Answer(cur), Record: cur}
				continue
			}
			var rates []processors.RateResult
			if len(a.Rates) > 0 {
				// Only a free key is charged, in the transaction that
				// records it, to every bucket or to none.
				var charged bool
				if rates, charged, err = charge(x.rates, x.now, a.Rates); err != nil {
					return err
				}
				if !charged {
					if limited == nil {
						limited = make(map[ledger.CallKey][]processors.RateResult)
					}
					limited[a.Key] = rates
					out[i] = processors.AdmitResult{Outcome: processors.Limited, Rates: rates}
					continue
				}
			}
			r := a.Record(x.now)
			if err := x.put(nil, r); err != nil {
				return err
			}
			out[i] = processors.AdmitResult{Outcome: processors.Admitted, Record: r, Rates: rates}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Claim implements processors.Store.
func (s *Store) Claim(ctx context.Context, cs []processors.Claim) ([]processors.ClaimResult, error) {
	if err := processors.CheckClaims(cs); err != nil {
		return nil, fmt.Errorf("boltstore claim: %w: %w", processors.ErrRejected, err)
	}
	for i, c := range cs {
		// The owner and the credential are stored; the key only looked
		// up (a key that is not valid UTF-8 was never admitted, so it is
		// Missing).
		for _, f := range []struct{ what, v string }{
			{"owner", c.Owner}, {"jti", c.Credential.JTI}, {"credential family", c.Credential.Family},
		} {
			if err := checkString(f.what, f.v); err != nil {
				return nil, fmt.Errorf("boltstore claim: claim %d: %w", i, err)
			}
		}
	}
	if len(cs) == 0 {
		return []processors.ClaimResult{}, nil
	}
	out := make([]processors.ClaimResult, len(cs))
	err := s.update(ctx, "claim", func(x *txn) error {
		for i, c := range cs {
			if err := ctx.Err(); err != nil {
				return err
			}
			cur, ok, err := x.get(c.Key)
			if err != nil {
				return err
			}
			if !ok {
				out[i] = processors.ClaimResult{Outcome: processors.Missing}
				continue
			}
			out[i] = processors.ClaimResult{Record: cur}
			// The hash first: a reused key learns nothing else and
			// moves nothing.
			if cur.ArgumentsHash != c.ArgumentsHash {
				out[i].Outcome = processors.Mismatch
				continue
			}
			switch {
			case cur.Status.Done():
				out[i].Outcome = processors.Finished
				continue
			case cur.Status == processors.StatusPending:
				out[i].Outcome = processors.NotReady
				continue
			case cur.Status == processors.StatusAuthorized:
				out[i].Outcome = processors.Claimed
			case cur.Status == processors.StatusExecuting && cur.LeaseUntil.Before(x.now) && cur.LeaseOwner == "":
				// Given back by its owner (Release), which sent
				// nothing.
				out[i].Outcome = processors.Claimed
			case cur.Status == processors.StatusExecuting && cur.LeaseUntil.Before(x.now):
				// Its owner may have sent, under the credential it
				// recorded.
				out[i].Outcome = processors.Reclaimed
				out[i].Prior = cur.Credential
			case cur.Status == processors.StatusExecuting:
				out[i].Outcome = processors.Busy
				continue
			default:
				// A newer build's status (a rolling upgrade): not this
				// build's to claim, nor a reason to fail the batch.
				out[i].Outcome = processors.NotReady
				continue
			}
			next := cur
			next.Status = processors.StatusExecuting
			next.Epoch++
			next.LeaseOwner = c.Owner
			next.LeaseUntil = x.now.Add(c.Lease)
			next.UpdatedAt = x.now
			next.LoggedSeq = max(cur.LoggedSeq, min(c.Logged, cur.Seq))
			// The call keeps its jti; the family is the claim's.
			next.Credential = processors.CallCredential{JTI: cmp.Or(cur.Credential.JTI, c.Credential.JTI), Family: c.Credential.Family}
			if out[i].Outcome == processors.Reclaimed {
				next.LapsedFamilies = processors.LapseFamily(cur.LapsedFamilies, cur.Credential.Family)
			}
			if err := x.put(&cur, next); err != nil {
				return err
			}
			out[i].Record = next
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// Complete implements processors.Store.
func (s *Store) Complete(ctx context.Context, cs []processors.Completion) ([]bool, error) {
	if err := processors.CheckCompletions(cs); err != nil {
		return nil, fmt.Errorf("boltstore complete: %w: %w", processors.ErrRejected, err)
	}
	if len(cs) == 0 {
		return []bool{}, nil
	}
	for _, c := range cs {
		if err := checkJournalName(c.Journal); err != nil {
			return nil, fmt.Errorf("boltstore complete: %w", err)
		}
	}
	applied := make([]bool, len(cs))
	err := s.update(ctx, "complete", func(x *txn) error {
		entries := make(map[string]*diskJournal)
		for i, c := range cs {
			if err := ctx.Err(); err != nil {
				return err
			}
			if c.Journal != "" {
				// Every journaled completion, applied or fenced out, as
				// pgstore does: the revert matches only the epoch that
				// applied.
				e := entries[c.Journal]
				if e == nil {
					var err error
					if e, err = x.journalEntry(c.Journal); err != nil {
						return err
					}
					entries[c.Journal] = e
				}
				e.Calls = append(e.Calls, journalCall{TenantID: c.Key.TenantID, IdempotencyKey: c.Key.IdempotencyKey, Epoch: c.Epoch, Seq: c.Seq, From: c.From})
			}
			cur, ok, err := x.get(c.Key)
			if err != nil {
				return err
			}
			if !ok || cur.Status != processors.StatusExecuting || cur.Epoch != c.Epoch {
				continue // fenced out
			}
			next := cur
			next.Status = c.Status
			next.Attempt = c.Attempt
			next.Result = c.Result
			next.Seq = c.Seq
			next.Outbox = c.Outbox
			next.LeaseOwner = ""
			next.LeaseUntil = time.Time{}
			next.UpdatedAt = x.now
			if c.Journal != "" {
				next.LoggedSeq = c.Seq
			}
			if err := x.put(&cur, next); err != nil {
				return err
			}
			applied[i] = true
		}
		for name, e := range entries {
			v, err := json.Marshal(e)
			if err != nil {
				return fmt.Errorf("encode journal entry %q: %v", name, err)
			}
			if err := x.journal.Put([]byte(name), v); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return applied, nil
}

// Release implements processors.Store.
func (s *Store) Release(ctx context.Context, rs []processors.Release) ([]bool, error) {
	if err := processors.CheckReleases(rs); err != nil {
		return nil, fmt.Errorf("boltstore release: %w: %w", processors.ErrRejected, err)
	}
	if len(rs) == 0 {
		return []bool{}, nil
	}
	keys := make([]ledger.CallKey, len(rs))
	for i, r := range rs {
		keys[i] = r.Key
	}
	// A key's second release at one epoch in a batch is not applied, as
	// in pgstore (the first of each key and epoch): the record stays
	// executing after the first, so the fence alone would let it pass.
	released := make(map[ledger.CallKey]bool, len(rs))
	return s.updateEach(ctx, "release", keys, func(i int, next *processors.Record, now time.Time) bool {
		r := rs[i]
		if next.Status != processors.StatusExecuting || next.Epoch != r.Epoch || released[r.Key] {
			return false // fenced out
		}
		released[r.Key] = true
		next.LeaseOwner = ""
		next.LeaseUntil = now.Add(r.After)
		next.UpdatedAt = now
		next.LapsedFamilies = processors.LapseFamily(next.LapsedFamilies, r.Sent)
		next.Attempt = max(next.Attempt, r.Attempt)
		return true
	})
}

// updateEach changes the records of keys one by one, in order, in one
// transaction, so that a later change of a key sees an earlier one's
// write: change edits next (the record as it is) and reports whether to
// write it, false for a record moved or fenced out meanwhile. A key
// without a record is left out. applied[i] reports the writes.
func (s *Store) updateEach(ctx context.Context, op string, keys []ledger.CallKey, change func(i int, next *processors.Record, now time.Time) bool) ([]bool, error) {
	applied := make([]bool, len(keys))
	err := s.update(ctx, op, func(x *txn) error {
		for i, k := range keys {
			if err := ctx.Err(); err != nil {
				return err
			}
			cur, ok, err := x.get(k)
			if err != nil {
				return err
			}
			next := cur
			if !ok || !change(i, &next, x.now) {
				continue
			}
			if err := x.put(&cur, next); err != nil {
				return err
			}
			applied[i] = true
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return applied, nil
}

// Move implements processors.Store. The moves run in batch order in one
// transaction, so a later move of a key sees an earlier one's write.
func (s *Store) Move(ctx context.Context, ms []processors.Move) ([]bool, error) {
	if err := processors.CheckMoves(ms); err != nil {
		return nil, fmt.Errorf("boltstore move: %w: %w", processors.ErrRejected, err)
	}
	if len(ms) == 0 {
		return []bool{}, nil
	}
	keys := make([]ledger.CallKey, len(ms))
	for i, m := range ms {
		keys[i] = m.Key
	}
	return s.updateEach(ctx, "move", keys, func(i int, next *processors.Record, now time.Time) bool {
		m := ms[i]
		if next.Status != m.From || next.Seq != m.FromSeq || next.UndoMarks != m.FromUndoMarks {
			return false // moved by someone else, or an undo started
		}
		if m.UnlessInProgress && next.Unanswered.Seq == m.FromSeq && next.Unanswered.InProgress {
			return false // a reconciler heard that the call is in progress
		}
		next.Status = m.To
		next.Seq = m.Seq
		next.Outbox = m.Outbox
		if m.Result != nil {
			next.Result = m.Result
		}
		next.UpdatedAt = now
		return true
	})
}

// MarkUndo implements processors.Store. UpdatedAt is left alone: the
// call took no step.
func (s *Store) MarkUndo(ctx context.Context, k ledger.CallKey, undoable []processors.Status) (processors.Status, bool, error) {
	if err := processors.CheckUndoable(undoable); err != nil {
		return "", false, fmt.Errorf("boltstore mark undo: %w: %w", processors.ErrRejected, err)
	}
	var (
		status        processors.Status
		found, marked bool
	)
	err := s.update(ctx, "mark undo", func(x *txn) error {
		cur, ok, err := x.get(k)
		// Set on every run: a batched write may run fn again.
		found, status, marked = ok, cur.Status, false
		if err != nil || !ok || !slices.Contains(undoable, cur.Status) {
			return err
		}
		next := cur
		next.UndoMarks++
		marked = true
		return x.put(&cur, next)
	})
	if err != nil {
		return "", false, err
	}
	if !found {
		return "", false, fmt.Errorf("%v: %w", k, processors.ErrNotFound)
	}
	return status, marked, nil
}

// NoteUnanswered implements processors.Store. UpdatedAt is left alone:
// the call took no step.
func (s *Store) NoteUnanswered(ctx context.Context, k ledger.CallKey, n processors.Unanswered) (processors.Unanswered, bool, error) {
	n.Since = n.Since.Round(0).UTC() // as it reads back
	var (
		note      processors.Unanswered
		found, ok bool
	)
	err := s.update(ctx, "note unanswered", func(x *txn) error {
		cur, there, err := x.get(k)
		// Set on every run: a batched write may run fn again.
		found, ok, note = there, false, processors.Unanswered{}
		if err != nil || !there || cur.Seq != n.Seq {
			return err
		}
		next := cur
		next.Unanswered = n.Merged(cur.Unanswered)
		note, ok = next.Unanswered, true
		if next.Unanswered.Equal(cur.Unanswered) {
			return nil
		}
		return x.put(&cur, next)
	})
	if err != nil {
		return processors.Unanswered{}, false, err
	}
	if !found {
		return processors.Unanswered{}, false, fmt.Errorf("%v: %w", k, processors.ErrNotFound)
	}
	return note, ok, nil
}

// MarkLogged implements processors.Store. LoggedSeq only grows, and only
// from at least the mark's Base; of a key's marks in the batch, the
// highest decides (its highest Base on a tie), as in pgstore. UpdatedAt
// is left alone (it dates the call's last step, not bookkeeping).
func (s *Store) MarkLogged(ctx context.Context, ls []processors.Logged) error {
	if len(ls) == 0 {
		return nil
	}
	best := make(map[ledger.CallKey]processors.Logged, len(ls))
	var order []ledger.CallKey
	for _, l := range ls {
		b, ok := best[l.Key]
		if !ok {
			order = append(order, l.Key)
		}
		if !ok || l.Seq > b.Seq || (l.Seq == b.Seq && l.Base > b.Base) {
			best[l.Key] = l
		}
	}
	return s.update(ctx, "mark logged", func(x *txn) error {
		for _, k := range order {
			l := best[k]
			cur, ok, err := x.get(l.Key)
			if err != nil {
				return err
			}
			if !ok || l.Seq <= cur.LoggedSeq || cur.LoggedSeq < l.Base {
				continue
			}
			next := cur
			next.LoggedSeq = l.Seq
			if err := x.put(&cur, next); err != nil {
				return err
			}
		}
		return nil
	})
}

// diskJournal is a journal entry as the journal bucket holds it.
type diskJournal struct {
	Created time.Time     `json:"created"`
	Calls   []journalCall `json:"calls"`
}

type journalCall struct {
	TenantID       string `json:"tenant_id"`
	IdempotencyKey string `json:"idempotency_key"`
	Epoch          int64  `json:"epoch"`
	Seq            int64  `json:"seq"`
	From           int64  `json:"from"`
}

// checkJournalName refuses a name the journal bucket cannot hold as
// given (see checkString; bbolt's key limit is far above any name).
func checkJournalName(name string) error {
	if err := checkString("journal name", name); err != nil {
		return err
	}
	if len(name) > bolt.MaxKeySize {
		return fmt.Errorf("journal name of %d bytes is over bbolt's key limit: %w", len(name), processors.ErrRejected)
	}
	return nil
}

// journalEntry returns the entry named, or a new one dated now.
func (x *txn) journalEntry(name string) (*diskJournal, error) {
	v := x.journal.Get([]byte(name))
	if v == nil {
		return &diskJournal{Created: x.now}, nil
	}
	var e diskJournal
	if err := json.Unmarshal(v, &e); err != nil {
		return nil, fmt.Errorf("decode journal entry %q: %v", name, err)
	}
	return &e, nil
}

// revert settles the entry named as not logged: the calls its completions
// applied to go back to LoggedSeq = From, and the entry goes.
// UpdatedAt stays the completion's: Unlogged's grace counts from it.
func (x *txn) revert(name []byte) error {
	e, err := x.journalEntry(string(name))
	if err != nil {
		return err
	}
	for _, c := range e.Calls {
		k := ledger.CallKey{TenantID: c.TenantID, IdempotencyKey: c.IdempotencyKey}
		cur, ok, err := x.get(k)
		if err != nil {
			return err
		}
		// As pgstore's revert: the completion's epoch, whatever was
		// marked since.
		if !ok || cur.Epoch != c.Epoch || cur.LoggedSeq <= c.From {
			continue
		}
		next := cur
		next.LoggedSeq = c.From
		if err := x.put(&cur, next); err != nil {
			return err
		}
	}
	return x.journal.Delete(name)
}

// Settle implements processors.Store.
func (s *Store) Settle(ctx context.Context, journals []string, logged bool) error {
	if len(journals) == 0 {
		return nil
	}
	return s.update(ctx, "settle", func(x *txn) error {
		for _, name := range journals {
			if x.journal.Get([]byte(name)) == nil {
				continue
			}
			if logged {
				if err := x.journal.Delete([]byte(name)); err != nil {
					return err
				}
				continue
			}
			if err := x.revert([]byte(name)); err != nil {
				return err
			}
		}
		return nil
	})
}

// settleStale settles as not logged the journal entries written before
// cutoff, oldest first, until they list limit calls (processors.Store's
// Unlogged). Entries live for one step, so there are few, and they are
// scanned rather than indexed; the write transaction is taken only when
// there is one to settle.
func (s *Store) settleStale(ctx context.Context, cutoff time.Time, limit int) error {
	stale := func(b *bolt.Bucket) ([][]byte, error) {
		type dated struct {
			name    []byte
			created time.Time
			calls   int
		}
		var all []dated
		err := b.ForEach(func(k, v []byte) error {
			var e diskJournal
			if err := json.Unmarshal(v, &e); err != nil {
				// Only this code writes entries, so this is a bug; one
				// entry must not stop every sweep. Its calls stay as
				// marked in advance: a human must look.
				s.log.Error("undecodable journal entry left alone; its calls' events may be missing from the log", "journal", string(k), "err", err)
				return nil
			}
			if e.Created.Before(cutoff) {
				all = append(all, dated{append([]byte(nil), k...), e.Created, len(e.Calls)})
			}
			return nil
		})
		slices.SortFunc(all, func(a, b dated) int {
			return cmp.Or(a.created.Compare(b.created), bytes.Compare(a.name, b.name))
		})
		var names [][]byte
		for calls, i := 0, 0; i < len(all) && calls < limit; i++ {
			names = append(names, all[i].name)
			calls += all[i].calls
		}
		return names, err
	}
	var found bool
	if err := s.db.View(func(tx *bolt.Tx) error {
		names, err := stale(tx.Bucket(bucketJournal))
		found = len(names) > 0
		return err
	}); err != nil || !found {
		return err
	}
	return s.update(ctx, "settle stale", func(x *txn) error {
		// Read again inside the write: another sweep may have settled
		// them meanwhile.
		names, err := stale(x.journal)
		if err != nil {
			return err
		}
		for _, name := range names {
			if err := x.revert(name); err != nil {
				return err
			}
		}
		return nil
	})
}

// Expired implements processors.Store: records executing under a lease
// that ended before Config.Now, oldest lease first.
func (s *Store) Expired(ctx context.Context, limit int) ([]processors.Record, error) {
	return s.ExpiredAfter(ctx, processors.Cursor{}, limit)
}

// ExpiredAfter implements processors.Store, from the lease index's entry
// after the cursor's on; the index's order (the lease's end, then the
// record key) is the one after follows.
func (s *Store) ExpiredAfter(ctx context.Context, after processors.Cursor, limit int) ([]processors.Record, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("boltstore expired: %w", err)
	}
	if limit <= 0 {
		return []processors.Record{}, nil
	}
	now := s.now()
	var out []processors.Record
	err := s.db.View(func(tx *bolt.Tx) error {
		x := &txn{records: tx.Bucket(bucketRecords), leases: tx.Bucket(bucketLeases), now: now}
		c := x.leases.Cursor()
		for lk := seekPast(c, after); lk != nil && len(out) < limit; lk, _ = c.Next() {
			if !keyTime(lk).Before(now) {
				break
			}
			v := x.records.Get(lk[8:])
			if v == nil {
				return fmt.Errorf("lease index entry %x has no record", lk)
			}
			var d diskRecord
			if err := json.Unmarshal(v, &d); err != nil {
				return fmt.Errorf("decode record %x: %v", lk[8:], err)
			}
			out = append(out, d.record())
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("boltstore expired: %w", err)
	}
	return out, nil
}

// Unlogged implements processors.Store: records in any status but
// executing with LoggedSeq < Seq, updated before Config.Now minus
// olderThan, oldest update first, read from the unlogged index, whose
// order (update time, then record key) is the one after follows.
func (s *Store) Unlogged(ctx context.Context, olderThan time.Duration, after processors.Cursor, limit int) ([]processors.Record, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("boltstore unlogged: %w", err)
	}
	if limit <= 0 {
		return []processors.Record{}, nil
	}
	cutoff := s.now().Add(-olderThan)
	if err := s.settleStale(ctx, cutoff, limit); err != nil {
		return nil, fmt.Errorf("boltstore unlogged: %w", err)
	}
	out := []processors.Record{}
	err := s.db.View(func(tx *bolt.Tx) error {
		records := tx.Bucket(bucketRecords)
		c := tx.Bucket(bucketUnlogged).Cursor()
		for k := seekPast(c, after); k != nil && len(out) < limit; k, _ = c.Next() {
			updated := keyTime(k)
			if !updated.Before(cutoff) {
				break
			}
			v := records.Get(k[8:])
			if v == nil {
				return fmt.Errorf("unlogged index entry %x has no record", k)
			}
			var d diskRecord
			if err := json.Unmarshal(v, &d); err != nil {
				return fmt.Errorf("decode record %x: %v", k[8:], err)
			}
			r := d.record()
			// Open rebuilds the index after any other writer (see the
			// package comment): a stale entry is a bug of this code.
			if !inUnlogged(&r) || !r.UpdatedAt.Equal(updated) {
				return fmt.Errorf("unlogged index entry %x is stale (record %v: status %q, seq %d, logged %d, updated %v); delete the %s bucket and reopen to rebuild the indexes", k, r.Key, r.Status, r.Seq, r.LoggedSeq, r.UpdatedAt, bucketUnlogged)
			}
			out = append(out, r)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("boltstore unlogged: %w", err)
	}
	return out, nil
}

// ByStatus implements processors.Store: read from the status index, in
// its order (update time, then record key). A status no record has, known
// or not, lists nothing.
func (s *Store) ByStatus(ctx context.Context, status processors.Status, limit int) ([]processors.Record, error) {
	return s.byStatus(ctx, "", status, processors.Cursor{}, false, limit)
}

// ByStatusAfter implements processors.Store: the status index from past
// the cursor's entry on.
func (s *Store) ByStatusAfter(ctx context.Context, status processors.Status, after processors.Cursor, limit int) ([]processors.Record, error) {
	return s.byStatus(ctx, "", status, after, false, limit)
}

// TenantByStatus implements processors.Store: the tenant's range of the
// tenant status index, whose order within a tenant is the status index's,
// so that no other tenant's entry is read.
func (s *Store) TenantByStatus(ctx context.Context, tenant string, status processors.Status, limit int) ([]processors.Record, error) {
	return s.byStatus(ctx, tenant, status, processors.Cursor{}, false, limit)
}

// TenantLatestByStatus implements processors.Store: TenantByStatus's
// range read backwards, from before the cursor's entry.
func (s *Store) TenantLatestByStatus(ctx context.Context, tenant string, status processors.Status, before processors.Cursor, limit int) ([]processors.Record, error) {
	if tenant == "" {
		return nil, errors.New("boltstore: TenantLatestByStatus needs a tenant")
	}
	if !before.IsZero() && before.Key.TenantID != tenant {
		return nil, errors.New("boltstore: TenantLatestByStatus from another tenant's cursor")
	}
	return s.byStatus(ctx, tenant, status, before, true, limit)
}

// byStatus lists the records in status, of tenant ("": of every tenant),
// after the cursor after (the zero Cursor: from the oldest; given only
// without a tenant), or newest first when latest, before the cursor
// after (the zero Cursor: from the newest).
func (s *Store) byStatus(ctx context.Context, tenant string, status processors.Status, after processors.Cursor, latest bool, limit int) ([]processors.Record, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("boltstore by status: %w", err)
	}
	if limit <= 0 {
		return []processors.Record{}, nil
	}
	// The entries of status (of tenant's, in the tenant status index) are
	// those under prefix; each ends with the record key, less its tenant
	// part, tp, when the prefix holds it.
	bucket, prefix, tp := bucketStatus, statusPrefix(status), []byte(nil)
	if tenant != "" && status.Listed() {
		tp = tenantPrefix(tenant, 0)
		bucket, prefix = bucketTenantStatus, append(slices.Clip(tp), prefix...)
	}
	out := []processors.Record{}
	err := s.db.View(func(tx *bolt.Tx) error {
		records := tx.Bucket(bucketRecords)
		c := tx.Bucket(bucket).Cursor()
		var k []byte
		next := c.Next
		if latest {
			next = c.Prev
		}
		switch {
		case after.IsZero() && !latest:
			k, _ = c.Seek(prefix)
		case after.IsZero():
			// From the last entry under prefix: the one before the
			// first entry past it (or the bucket's last).
			if end := prefixEnd(prefix); end == nil {
				k, _ = c.Last()
			} else if k, _ = c.Seek(end); k == nil {
				k, _ = c.Last()
			} else {
				k, _ = c.Prev()
			}
		default:
			// The cursor's entry, whether or not its record is still
			// there: in the bucket read, prefix, then the time, then
			// the record key less the tenant part the prefix holds.
			// The tenant's own (TenantLatestByStatus checks), so that
			// rk starts with tp.
			rk := recordKey(after.Key)
			from := append(slices.Clip(prefix), timeKey(after.At, rk[len(tp):])...)
			k, _ = c.Seek(from)
			switch {
			case latest && k == nil:
				k, _ = c.Last() // every entry is before it
			case latest:
				k, _ = c.Prev() // k is at or past it: the one before
			case bytes.Equal(k, from):
				k, _ = c.Next() // past the cursor's own entry
			}
		}
		for ; k != nil && bytes.HasPrefix(k, prefix) && len(out) < limit; k, _ = next() {
			if s.entryRead != nil {
				s.entryRead(k)
			}
			tk := k[len(prefix):]
			if len(tk) < 8 {
				return fmt.Errorf("%s index entry %x is malformed", bucket, k)
			}
			rk := append(slices.Clip(tp), tk[8:]...)
			v := records.Get(rk)
			if v == nil {
				return fmt.Errorf("%s index entry %x has no record", bucket, k)
			}
			var d diskRecord
			if err := json.Unmarshal(v, &d); err != nil {
				return fmt.Errorf("decode record %x: %v", rk, err)
			}
			r := d.record()
			// As in Unlogged: only a bug leaves a stale entry.
			if r.Status != status || !r.UpdatedAt.Equal(keyTime(tk)) {
				return fmt.Errorf("%s index entry %x is stale (record %v: status %q, updated %v); delete the %s bucket and reopen to rebuild the indexes", bucket, k, r.Key, r.Status, r.UpdatedAt, bucket)
			}
			if tenant != "" && r.Key.TenantID != tenant {
				// A status the tenant status index does not hold: the
				// status index, the other tenants' records skipped.
				continue
			}
			out = append(out, r)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("boltstore by status: %w", err)
	}
	return out, nil
}

// Get implements processors.Store.
func (s *Store) Get(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	if err := ctx.Err(); err != nil {
		return processors.Record{}, fmt.Errorf("boltstore get: %w", err)
	}
	var (
		r  processors.Record
		ok bool
	)
	err := s.db.View(func(tx *bolt.Tx) error {
		var err error
		r, ok, err = (&txn{records: tx.Bucket(bucketRecords)}).get(k)
		return err
	})
	if err != nil {
		return processors.Record{}, fmt.Errorf("boltstore get: %w", err)
	}
	if !ok {
		return processors.Record{}, fmt.Errorf("%v: %w", k, processors.ErrNotFound)
	}
	return r, nil
}

// ReadBack implements processors.Store: a Get, since every write
// has ended when its call returns (the one process that owns the file
// writes it, one transaction at a time).
func (s *Store) ReadBack(ctx context.Context, k ledger.CallKey) (processors.Record, error) {
	return s.Get(ctx, k)
}

// prefixEnd is the least key past every key that starts with prefix; nil
// when there is none (prefix all 0xff).
func prefixEnd(prefix []byte) []byte {
	end := slices.Clone(prefix)
	for i := len(end) - 1; i >= 0; i-- {
		if end[i] < 0xff {
			end[i]++
			return end[:i+1]
		}
	}
	return nil
}
