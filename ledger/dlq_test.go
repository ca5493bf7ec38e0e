package ledger

import (
	"bytes"
	"strconv"
	"strings"
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"
)

// A DLQ record always fits a default Kafka record, whatever the request
// held: the copy is cut and the cut said, tokens are redacted before the
// cut, and a request that fits is copied whole.
func TestDLQRecordBounded(t *testing.T) {
	t.Parallel()
	token := "eyJhbGciOiJFZERTQSJ9." + strings.Repeat("p", 600) + "." + strings.Repeat("s", 86)
	tests := []struct {
		name      string
		key       []byte
		value     []byte
		detail    string
		wantCut   bool
		wantValue []byte // when not cut
	}{
		{name: "small", key: []byte("k"), value: []byte(`{"a":1}`), detail: "invalid_json", wantValue: []byte(`{"a":1}`)},
		{name: "at the bound", key: []byte("k"), value: bytes.Repeat([]byte("x"), DLQMaxValueBytes), detail: "too_large",
			wantValue: bytes.Repeat([]byte("x"), DLQMaxValueBytes)},
		{name: "one over", key: []byte("k"), value: bytes.Repeat([]byte("x"), DLQMaxValueBytes+1), detail: "too_large", wantCut: true},
		{name: "10 MB", key: []byte("k"), value: bytes.Repeat([]byte("y"), 10<<20), detail: "too_large", wantCut: true},
		// A token that straddles the cut must not leave its first half.
		{name: "token across the cut", key: []byte("k"),
			value:  append(bytes.Repeat([]byte("z"), DLQMaxValueBytes-300), token+" "+strings.Repeat("z", 1<<20)...),
			detail: "too_large", wantCut: true},
		{name: "huge key and detail", key: bytes.Repeat([]byte("k"), 1<<20), value: []byte("{}"),
			detail: "unknown field " + strings.Repeat("\\u2028", 100_000), wantValue: []byte("{}")},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			src := &kgo.Record{Topic: "requests", Partition: 3, Offset: 7, Key: tc.key, Value: tc.value}
			r := DLQRecord("dlq", src, "too_large", tc.detail)
			size := len(r.Key) + len(r.Value)
			for _, h := range r.Headers {
				size += len(h.Key) + len(h.Value)
			}
			if size > 600<<10 {
				t.Errorf("DLQ record of %d bytes; want at most 600 KiB", size)
			}
			if got := string(Header(r, HeaderDLQReason)); got != "too_large" {
				t.Errorf("reason %q; want too_large", got)
			}
			if got := string(Header(r, HeaderDLQSource)); got != "requests/3/7" {
				t.Errorf("source %q; want requests/3/7", got)
			}
			cut := Header(r, HeaderDLQTruncated)
			switch {
			case tc.wantCut:
				if string(cut) != strconv.Itoa(len(tc.value)) || len(r.Value) != DLQMaxValueBytes || !bytes.HasPrefix(RedactTokens(tc.value), r.Value) {
					t.Errorf("cut copy: %d bytes, header %q; want the first %d bytes of the redacted value and header %d", len(r.Value), cut, DLQMaxValueBytes, len(tc.value))
				}
			case cut != nil || !bytes.Equal(r.Value, tc.wantValue):
				t.Errorf("copy of %d bytes, cut header %q; want the whole %d-byte value and no cut header", len(r.Value), cut, len(tc.wantValue))
			}
			if bytes.Contains(r.Value, []byte("eyJ")) {
				t.Errorf("part of a token is in the DLQ copy")
			}
		})
	}
}

// TestDLQRecordRedactsTokens: an assertion whose header is not encoded
// as "eyJ" (a space after the brace) leaves no trace in the DLQ record's
// key, value or detail.
func TestDLQRecordRedactsTokens(t *testing.T) {
	t.Parallel()
	tok := jws(`{ "alg": "EdDSA", "typ": "agent-assertion+jwt", "kid": "k1" }`, `{"sub":"u_88","tenant":"t_acme"}`, strings.Repeat("s", 64))
	_, sig, _ := strings.Cut(tok[strings.IndexByte(tok, '.')+1:], ".")
	src := &kgo.Record{Topic: "requests", Key: []byte("t_acme/" + tok), Value: []byte(`{"assertion":"` + tok + `",`)}
	r := DLQRecord("dlq", src, "invalid_json", "near "+tok)
	for name, got := range map[string][]byte{"key": r.Key, "value": r.Value, "detail": Header(r, HeaderDLQDetail)} {
		if bytes.Contains(got, []byte(sig)) || !bytes.Contains(got, []byte(Redacted)) {
			t.Errorf("DLQ %s = %q; want the token redacted", name, got)
		}
	}
}
