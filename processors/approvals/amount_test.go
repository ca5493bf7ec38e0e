package approvals

import (
	"encoding/json"
	"math"
	"strconv"
	"testing"
)

// The preview's amount counts amount_cents in the currency's minor unit:
// a yen has none, a Bahraini dinar three decimals. Before, every currency
// was shown in hundredths, a 4,500 yen refund as "45.00 JPY".
func TestAmountInTheCurrencysMinorUnit(t *testing.T) {
	for _, tc := range []struct {
		cents    int64
		currency string
		want     string
	}{
		{4500, "AUD", "45.00 AUD"},
		{5, "EUR", "0.05 EUR"},
		{-4505, "USD", "-45.05 USD"},
		{4500, "JPY", "4500 JPY"},
		{-7, "KRW", "-7 KRW"},
		{4500, "BHD", "4.500 BHD"},
		{45, "KWD", "0.045 KWD"},
		{12345, "CLF", "1.2345 CLF"},
		{4500, "jpy", "4500 JPY"},
		{math.MinInt64, "USD", "-92233720368547758.08 USD"},
	} {
		args := map[string]any{"amount_cents": json.Number(strconv.FormatInt(tc.cents, 10)), "currency": tc.currency}
		if got := amount(args); got != tc.want {
			t.Errorf("amount(%d %s) = %q; want %q", tc.cents, tc.currency, got, tc.want)
		}
	}
	for _, args := range []map[string]any{
		{"amount_cents": json.Number("1.5"), "currency": "USD"},
		{"amount_cents": json.Number("100")},
		{"currency": "USD"},
		{"amount_cents": json.Number("100"), "currency": ""},
		{"amount_cents": json.Number("100"), "currency": "JPYX"},
		{"amount_cents": json.Number("100"), "currency": "JP"},
		{"amount_cents": json.Number("100"), "currency": "J\x1bY"},
	} {
		if got := amount(args); got != "" {
			t.Errorf("amount(%v) = %q; want none", args, got)
		}
	}
}
