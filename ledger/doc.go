// Package ledger is the log side of Toolcall Ledger: what an agent sends
// (Envelope, and the one strict decoder that validation, hashing and
// execution share), what the ledger appends (Event and its versioned
// encoding), how calls are identified (CallKey, tenant-scoped), and how
// processors talk to Kafka (topics, the transactional consume-process-produce
// Loop, readers of one call's events).
//
// Files:
//
//	key.go             CallKey, the tenant-scoped identity of a call
//	envelope.go        Envelope and Scope
//	decode.go          Decode: the strict JSON decoder and DecodeError
//	canonical.go       Canonical (RFC 8785) and ArgumentsHash
//	redact.go          Redact, for arguments in events and results; RedactTokens, for DLQ copies
//	envelope_decode.go DecodeEnvelope, LenientKey
//	event.go           Event, its encoding and the outbox form
//	kafka.go           topics, client options, DLQ records
//	kafkasec.go        Security: TLS and SASL for every Kafka client
//	dlq.go             the bounds of a DLQ record
//	loop.go            Loop: GroupTransactSession, read_committed, one transaction per step; its metrics and readiness
//	reader.go          the partitioner and ReadCall / CallBefore / FollowCall
package ledger
